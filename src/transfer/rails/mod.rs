//! Several connections to one peer used as one: rails (see [`Rails`]).

#[cfg(feature = "tokio")]
mod aio;
mod finished;
mod grant;
mod ops;
mod plan;
mod setup;
mod transfer;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::transfer::engine::completion::Ticket;
use crate::transfer::request::parts::{Gather, Scatter};
use crate::transfer::request::received::Received;
use crate::transfer::request::Request;
use crate::transfer::{Connection, Options};
#[cfg(doc)]
use crate::RemoteDesc;

#[cfg(feature = "tokio")]
pub use aio::{AsyncRails, AsyncRailsListener, StripedOp};
pub use finished::{Finished, RailReport};
pub use grant::RailsGrant;
pub use setup::RailsListener;
pub use transfer::Striped;

/// The most rails a group holds (a piece's routes are kept per rail).
pub const MAX_RAILS: usize = 16;

/// How a [`Rails`] group cuts and spreads transfers, and how its connections are made.
#[derive(Debug, Clone)]
pub struct RailOptions {
    /// Every rail's connection options (each rail's device comes from its protection domain;
    /// [`crate::transfer::DeviceChoice::name`] is ignored).
    pub conn: Options,
    /// The largest slice one work request carries (default 256 KiB; 1 B..=1 GiB). Smaller
    /// slices spread and fail over more finely, at a work request each.
    pub slice: usize,
    /// Bytes a rail may have in flight before the next slice waits for one of its completions
    /// (default 4 MiB; shared by every transfer on the group). A transfer with nothing in
    /// flight always posts one slice.
    pub window: usize,
    /// Whether a buffer prefers the rails whose device is on its NUMA node (default `true`):
    /// the other rails take its slices only while no local rail lives. Devices and pages of
    /// unknown node count as local everywhere. With one NIC per socket, a buffer then goes over
    /// its socket's NIC only (no cross-socket DMA); set `false` to stripe every buffer over
    /// every rail.
    pub prefer_local: bool,
}

impl Default for RailOptions {
    fn default() -> RailOptions {
        RailOptions { conn: Options::default(), slice: 256 << 10, window: 4 << 20, prefer_local: true }
    }
}

/// A rail's connection, as its front end holds it. (One per rail, in a `Vec`: the variants'
/// sizes do not matter, and a box would add a load to every post.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum Link {
    Blocking(Connection),
    #[cfg(feature = "tokio")]
    Async(crate::transfer::AsyncConnection),
}

impl Link {
    fn conn(&self) -> &Connection {
        match self {
            Link::Blocking(c) => c,
            #[cfg(feature = "tokio")]
            Link::Async(c) => c.conn(),
        }
    }
}

/// One rail: a connection and the bytes in flight on it.
pub(crate) struct Rail {
    link: Link,
    /// Bytes posted and not yet completed, by every transfer (parked slices included: their
    /// release subtracts).
    load: Arc<AtomicU64>,
    /// Bytes moved by completed slices.
    moved: AtomicU64,
    device: String,
    node: Option<u32>,
    gbps: Option<f64>,
    /// Keys of live rails grants bound through this rail's connection (see `grant.rs`): while
    /// any lives, the rail is not restored (a peer would use a key of the old QP on the new).
    grant_keys: AtomicUsize,
}

impl Rail {
    fn new(link: Link) -> Rail {
        let conn = link.conn();
        let ctx = conn.pd().context();
        let device = ctx.name().to_string();
        let node = ctx.numa_node();
        let gbps = ctx.port(conn.qp().port()).ok().and_then(|p| p.gbps());
        Rail {
            link,
            load: Arc::new(AtomicU64::new(0)),
            moved: AtomicU64::new(0),
            device,
            node,
            gbps,
            grant_keys: AtomicUsize::new(0),
        }
    }

    pub(crate) fn conn(&self) -> &Connection {
        self.link.conn()
    }

    /// Posts `req` if the send queue has room (and, on an async connection, no earlier
    /// request waits for it); `Ok(None)` otherwise. Never waits.
    ///
    /// # Safety
    /// As [`Connection::submit`].
    pub(crate) unsafe fn try_post(&self, req: &Request) -> Result<Option<Ticket>> {
        match &self.link {
            // SAFETY: the caller's contract.
            Link::Blocking(c) => unsafe { c.try_submit(req) },
            // SAFETY: the caller's contract.
            #[cfg(feature = "tokio")]
            Link::Async(c) => unsafe { c.shared().try_post(req) },
        }
    }

    /// A buffer was parked with this rail: on an async connection, the driver must reap.
    pub(crate) fn parked(&self) {
        #[cfg(feature = "tokio")]
        if let Link::Async(c) = &self.link {
            c.shared().parked();
        }
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn link(&self) -> &Link {
        &self.link
    }

    /// The async connection's wake-up on its next completion (nothing for a blocking one).
    #[cfg(feature = "tokio")]
    pub(crate) fn wake_on_completion(&self, cx: &std::task::Context<'_>) {
        if let Link::Async(c) = &self.link {
            c.shared().wake_on_completion(cx);
        }
    }

    /// Whether the rail's connection has not failed.
    pub(crate) fn alive(&self) -> bool {
        self.conn().core().failure().is_none()
    }

    pub(crate) fn device(&self) -> &str {
        &self.device
    }

    pub(crate) fn node(&self) -> Option<u32> {
        self.node
    }

    pub(crate) fn outstanding(&self) -> u64 {
        self.load.load(Ordering::Relaxed)
    }

    /// The counter a slice's bytes stay in until its completion (or its parked buffer's
    /// release) takes them out.
    pub(crate) fn load(&self) -> &Arc<AtomicU64> {
        &self.load
    }

    /// Counts a grant's key bound through this rail (`+1`) or revoked, released or leaked
    /// (`-1`: its grant is over, the peer has no use for its descriptor).
    pub(crate) fn count_grant_key(&self, made: bool) {
        if made {
            self.grant_keys.fetch_add(1, Ordering::Relaxed);
        } else {
            self.grant_keys.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn moved(&self, bytes: u64) {
        self.moved.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// What a rail is and how it fares ([`Rails::info`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RailInfo {
    /// Its index in the group.
    pub rail: usize,
    /// This side's device.
    pub device: String,
    /// The device's NUMA node, if the system says.
    pub numa_node: Option<u32>,
    /// The port's signalling rate in Gb/s, if known.
    pub gbps: Option<f64>,
    /// Whether its connection still works.
    pub alive: bool,
    /// Bytes moved by completed slices of striped transfers.
    pub bytes: u64,
    /// Bytes posted on it and not yet completed.
    pub outstanding: u64,
}

/// Several connections to one peer used as one: rails.
///
/// A [`Rails`] group holds one [`Connection`] per device pair between two hosts (rail `i` joins
/// this side's `i`-th device to the peer's `i`-th, as rail-optimised clusters wire NIC `i` of
/// every host to the same switch). Large WRITEs and READs are cut into slices
/// ([`RailOptions::slice`]) and spread over the rails by outstanding bytes — the rail with the
/// fewest bytes in flight takes the next slice, so a slow rail gets fewer — preferring, for each
/// buffer, the rails whose device sits on the buffer's NUMA node. A list of (local, remote)
/// pieces — KV-cache pages, tensor shards — goes as one transfer, completed once, with an error
/// per piece. A rail that fails (its link cut, the peer's port down, the device removed, a
/// keepalive lost) has its unfinished slices posted again on the rails that live: the transfer
/// succeeds while one rail reaches each piece, and reports which rail failed and why. A rail
/// that goes silent (a path that drops everything) is failed once a slice on it has waited its
/// connection's [`op_timeout`](crate::transfer::WaitOptions::op_timeout). A piece the peer
/// refuses (a wrong key or range) fails alone — but, as any refused request does to an RC
/// connection, it breaks the rail its slice was on; the other slices on that rail go to the
/// others.
///
/// Remote memory is named by a [`RemoteDesc`]: one rkey per device of the exposing side
/// ([`crate::heap::Exposed::desc`], or a window per rail over one owned buffer:
/// [`Rails::grant`]), of which each rail uses the one of the device at its far end. Local memory is owned, as for [`crate::transfer::Pending`]: a heap bound to every rail's
/// protection domain gives a buffer a key on each
/// ([`HeapBuilder::bind`](crate::heap::HeapBuilder::bind) once per device).
///
/// ```no_run
/// use mralloc::transfer::{RailOptions, Rails};
/// use mralloc::verbs::{Context, Pd};
/// use mralloc::{Heap, RemoteDesc};
///
/// // One protection domain per device, one heap registered with all of them.
/// let pds = ["mlx5_0", "mlx5_1"].map(|d| Pd::new(&Context::open(d)?)).into_iter().collect::<mralloc::Result<Vec<_>>>()?;
/// let heap = pds.iter().fold(Heap::builder(), |b, pd| b.bind(pd)).build()?;
/// let rails = Rails::connect("10.0.0.2:7471", &pds, RailOptions::default())?;
/// // The peer sent its buffer's descriptor (a key per device of its own).
/// let mut msg = heap.alloc(RemoteDesc::MAX_ENCODED_LEN)?;
/// let got = rails.recv(&mut msg)?;
/// let remote = RemoteDesc::from_bytes(&msg[..got.len])?;
/// // 64 MiB, striped over both rails; the buffer comes back when every slice completed.
/// let data = heap.alloc(64 << 20)?;
/// let done = rails.post_write(data, &remote, 0)?.wait();
/// for r in done.rails() {
///     println!("rail {} ({}): {} bytes, failure: {:?}", r.rail, r.device, r.bytes, r.failure);
/// }
/// let (data, _) = done.into_one()?;
/// # drop(data); Ok::<(), mralloc::Error>(())
/// ```
pub struct Rails {
    group: Arc<Group>,
    /// Where the application's part of rail 0's peer blob starts.
    blob_at: usize,
}

/// The rails and options, shared with the transfers in flight (which outlive no rail).
pub(crate) struct Group {
    /// Shared by the groups a restore makes (transfers in flight keep the group they began with).
    rails: Vec<Arc<Rail>>,
    opts: RailOptions,
}

impl Group {
    pub(crate) fn rails(&self) -> &[Arc<Rail>] {
        &self.rails
    }

    pub(crate) fn options(&self) -> &RailOptions {
        &self.opts
    }

    /// A report per rail of a transfer that moved nothing yet.
    pub(crate) fn blank_reports(&self) -> Vec<RailReport> {
        self.rails.iter().enumerate().map(|(rail, r)| RailReport::blank(rail, r.device())).collect()
    }
}

/// Checks what a group's options may hold.
///
/// # Errors
/// [`Error::InvalidArgument`] for a slice size outside 1 B..=1 GiB.
pub(crate) fn check_options(opts: &RailOptions) -> Result<()> {
    if opts.slice == 0 || opts.slice > 1 << 30 {
        return Err(Error::InvalidArgument(format!("a slice is 1 B..=1 GiB, got {} bytes", opts.slice)));
    }
    Ok(())
}

impl std::fmt::Debug for Rails {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rails").field("rails", &self.info()).finish()
    }
}

impl Rails {
    /// A group of connections made any way (TCP, RDMA CM, [`Connection::pair`]), rail `i`
    /// being `conns[i]`. The peer groups its ends in the same order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no connections, more than [`MAX_RAILS`], or a slice size
    /// outside 1 B..=1 GiB.
    pub fn new(conns: Vec<Connection>, opts: RailOptions) -> Result<Rails> {
        Rails::from_links(conns.into_iter().map(Link::Blocking).collect(), opts)
    }

    /// A group of `links` (all of one front end).
    ///
    /// # Errors
    /// As [`Rails::new`].
    pub(crate) fn from_links(links: Vec<Link>, opts: RailOptions) -> Result<Rails> {
        if links.is_empty() || links.len() > MAX_RAILS {
            let n = links.len();
            return Err(Error::InvalidArgument(format!("a rail group holds 1..={MAX_RAILS} connections, got {n}")));
        }
        check_options(&opts)?;
        let rails = links.into_iter().map(|l| Arc::new(Rail::new(l))).collect();
        Ok(Rails { group: Arc::new(Group { rails, opts }), blob_at: 0 })
    }

    /// How many rails the group has (dead ones included).
    pub fn len(&self) -> usize {
        self.group.rails.len()
    }

    /// Always `false`: a group has at least one rail.
    pub fn is_empty(&self) -> bool {
        self.group.rails.is_empty()
    }

    /// Rail `i`'s connection, for anything the group does not do itself.
    ///
    /// # Panics
    /// If `i >= self.len()`.
    pub fn rail(&self, i: usize) -> &Connection {
        self.group.rails[i].conn()
    }

    /// Every rail: device, NUMA node, port rate, whether it lives, bytes moved and in flight.
    pub fn info(&self) -> Vec<RailInfo> {
        self.group
            .rails
            .iter()
            .enumerate()
            .map(|(rail, r)| RailInfo {
                rail,
                device: r.device.clone(),
                numa_node: r.node,
                gbps: r.gbps,
                alive: r.alive(),
                bytes: r.moved.load(Ordering::Relaxed),
                outstanding: r.outstanding(),
            })
            .collect()
    }

    /// The options in force.
    pub fn options(&self) -> &RailOptions {
        &self.group.opts
    }

    pub(crate) fn set_blob_at(&mut self, at: usize) {
        self.blob_at = at;
    }

    pub(crate) fn blob_at(&self) -> usize {
        self.blob_at
    }

    pub(crate) fn group(&self) -> &Arc<Group> {
        &self.group
    }

    /// The rail messages go on: the first that lives. Both peers pick the same one while they
    /// see the same rails fail; after a failure, a message in flight on the dead rail is lost
    /// with it (messages are ordered on one rail only).
    ///
    /// # Errors
    /// The first rail's failure if every rail failed.
    pub fn messages(&self) -> Result<&Connection> {
        Ok(self.rail(self.messages_index()?))
    }

    /// The index of the message rail.
    pub(crate) fn messages_index(&self) -> Result<usize> {
        match self.group.rails.iter().position(|r| r.alive()) {
            Some(i) => Ok(i),
            None => Err(self.group.rails[0].conn().error().unwrap_or(Error::Closed)),
        }
    }

    /// SEND on the message rail ([`Rails::messages`]), as [`Connection::send`].
    ///
    /// # Errors
    /// As [`Rails::messages`] and [`Connection::send`].
    pub fn send<G: Gather + ?Sized>(&self, local: &G) -> Result<()> {
        self.messages()?.send(local)
    }

    /// Receive on the message rail ([`Rails::messages`]), as [`Connection::recv`].
    ///
    /// # Errors
    /// As [`Rails::messages`] and [`Connection::recv`].
    pub fn recv<S: Scatter + ?Sized>(&self, local: &mut S) -> Result<Received> {
        self.messages()?.recv(local)
    }

    /// Puts `conn` in rail `i`'s place — a new connection between the two sides' `i`-th devices
    /// once the old one failed (its link back up, its device back): transfers started from now
    /// on use it; those in flight finish with the rails they began with. Both sides restore
    /// their end (the peer's [`Rails::restore`] with its end of the same connection).
    ///
    /// A grant made over the group ([`Rails::grant`]) before has a key bound through the old
    /// connection under the same device's GID, which the peer would use on the new one (and
    /// break it): while such a grant lives the rail is not restored. Revoke or drop it first,
    /// and grant again after (a forgotten grant keeps the rail from being restored for good).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `i` is not a rail of the group, `conn` has failed already,
    /// or a live grant has a key on rail `i` (`conn` is dropped).
    pub fn restore(&mut self, i: usize, conn: Connection) -> Result<()> {
        self.restore_link(i, Link::Blocking(conn))
    }

    /// [`Rails::restore`] for any front end's link.
    pub(crate) fn restore_link(&mut self, i: usize, link: Link) -> Result<()> {
        if i >= self.len() {
            return Err(Error::InvalidArgument(format!("rail {i} of a group of {}", self.len())));
        }
        if let Some(e) = link.conn().error() {
            return Err(Error::InvalidArgument(format!("restoring rail {i} with a failed connection: {e}")));
        }
        let keys = self.group.rails[i].grant_keys.load(Ordering::Relaxed);
        if keys > 0 {
            return Err(Error::InvalidArgument(format!(
                "rail {i} carries keys of {keys} live grants (Rails::grant): revoke or drop them first"
            )));
        }
        let mut rails = self.group.rails.clone();
        rails[i] = Arc::new(Rail::new(link));
        self.group = Arc::new(Group { rails, opts: self.group.opts.clone() });
        Ok(())
    }

    /// Closes every rail ([`Connection::close`]).
    ///
    /// # Errors
    /// The first rail's close error (every rail is closed regardless).
    pub fn close(&self) -> Result<()> {
        self.group.rails.iter().map(|r| r.conn().close()).fold(Ok(()), Result::and)
    }
}
