//! `Connection`: one RC queue pair with its CQs, completion routing and failure state.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::transfer::engine::completion::{Core, Failure, Mode};
use crate::transfer::engine::stats::ConnectionStats;
use crate::transfer::exact::Windows;
use crate::transfer::liveness::keepalive::Keepalive;
use crate::transfer::liveness::link::Link;
use crate::transfer::liveness::watch::{watch, Registration, Source};
use crate::transfer::{Options, WaitMode};
use crate::verbs::{Access, Cq, Endpoint, Pd, Qp, RegisteredBuf};

mod close;
mod queues;

/// How long a failed connection waits for the device to flush its outstanding requests before
/// it declares their memory lost (leaked, never released).
pub(crate) const FLUSH_WAIT: Duration = Duration::from_secs(5);

/// A reliable connection to one peer: it owns the queue pair and routes completions to their
/// waiters. Its operations come in three front ends with the same names and argument order:
/// blocking calls on borrowed memory ([`Connection::write`], [`Connection::read`],
/// [`Connection::send`], [`Connection::recv`], atomics), owned non-blocking ones returning a
/// [`crate::transfer::Pending`] ([`Connection::post_write`], `post_read`, `post_send`,
/// `post_recv`), and [`Connection::batch`] (many requests, one doorbell); each takes one buffer
/// or a gather/scatter list.
///
/// Once any operation fails (a failed completion, a timeout, a failing verbs call on the
/// completion path), the QP is in the error state and every later post fails fast with the
/// original error. [`Connection::close`] (or dropping the connection) moves the QP to the error
/// state, waits for the device to flush what is outstanding and releases the buffers of
/// operations nobody waits for.
///
/// An idle peer is not a dead one: a receive waits as long as the peer stays silent (unless
/// [`WaitOptions::recv_timeout`](crate::transfer::WaitOptions::recv_timeout) says otherwise). A
/// dead one is found by mralloc's liveness thread, which fails the connection with
/// [`Error::Disconnected`] (flushing whatever is outstanding) when the TCP stream it was set up
/// over closes (the peer dropped the connection or its process exited), RDMA CM reports it
/// disconnected, the device reports its port down, its QP in error or a fatal error, or — with
/// [`Options::keepalive`], for peers whose host or path dies without a word — a probe goes
/// unanswered.
///
/// `fork()`: a child's copy of a connection is the parent's. Every operation on it fails with
/// [`Error::Forked`] (before taking any lock a parent thread may have held at the fork), and
/// dropping it destroys nothing (the QP, its CM id and the buffers it holds stay the
/// parent's, which keeps using them). The child may open devices and connect on its own.
pub struct Connection {
    /// Destroyed in `Drop`, before the buffers still held are released.
    qp: ManuallyDrop<Qp>,
    pd: Pd,
    peer: Endpoint,
    peer_blob: Vec<u8>,
    /// The rights the peer's QP grants this side (as its setup message said): untrusted, they
    /// only make [`Connection::request`] refuse earlier, never enable anything.
    peer_grants: Access,
    /// The peer's IP address and port, as setup saw it (none for a pair).
    peer_addr: Option<std::net::SocketAddr>,
    opts: Options,
    core: Arc<Core>,
    /// 8-byte landing zone for atomics' old values.
    scratch: Mutex<RegisteredBuf>,
    /// Keeps the connection (and the control channel set up with it, if any) watched: dropped
    /// first, before what it
    /// names (the QP, the TCP stream or CM channel in `kept`) goes away — in `Drop`, and by
    /// field order should that unwind.
    watch: Option<Registration>,
    /// What the setup path must keep alive as long as the connection (its TCP stream, its RDMA
    /// CM id and channel), dropped after the QP is destroyed.
    kept: Vec<Box<dyn Send + Sync>>,
    /// What the connection watcher fails this connection through.
    link: Arc<Link>,
    /// The other end of a [`Connection::pair`]: told when this end goes away (no stream or CM
    /// id tells it, the process being the same).
    pair_peer: Option<Weak<Link>>,
    /// The memory windows of grants and lent memory bound through this QP and not released
    /// yet: deallocated in `Drop` once the QP is flushed, before it is destroyed.
    windows: Arc<Windows>,
    /// Scatter entries an RDMA READ may have: the QP's send entries, bounded by the device's
    /// `max_sge_rd` (iWARP devices allow one).
    read_sge: u32,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("local", &self.qp.endpoint())
            .field("peer", &self.peer)
            .field("failed", &self.core.failure())
            .finish()
    }
}

impl Connection {
    /// Wraps a QP that is already connected (RTS).
    pub(crate) fn wrap(
        pd: &Pd,
        opts: &Options,
        (qp, send_cq, recv_cq): (Qp, Cq, Cq),
        peer: Endpoint,
        peer_blob: Vec<u8>,
        peer_grants: Access,
    ) -> Result<Connection> {
        let scratch = RegisteredBuf::new(pd, 64, Access::LOCAL_WRITE)?;
        // Unknown (the query failed): one entry works on every device.
        let max_sge_rd = pd.context().attributes().map_or(1, |a| a.max_sge_rd.max(1) as u32);
        let read_sge = qp.caps().max_send_sge.min(max_sge_rd);
        let mut opts = opts.clone();
        opts.qp.send_depth = qp.caps().max_send_wr.min(opts.qp.send_depth).max(1);
        opts.qp.recv_depth = qp.caps().max_recv_wr.min(opts.qp.recv_depth).max(1);
        let mode = match opts.wait.mode {
            WaitMode::BusyPoll => Mode::BusyPoll,
            WaitMode::Event => Mode::Event,
            WaitMode::Poller(_) => Mode::Poller,
        };
        let core =
            Arc::new(Core::new(send_cq, recv_cq, (opts.qp.send_depth, opts.qp.recv_depth), mode, opts.wait.spin));
        // What the device was told (an RDMA CM connection's ACK timeout comes from the path, not
        // the options), else what the options asked for.
        let keepalive =
            opts.keepalive.map(|k| Keepalive::new(k, qp.retry_time().unwrap_or_else(|_| opts.qp.retry_time())));
        let link = Arc::new(Link::new(&core, &qp, keepalive));
        if let WaitMode::Poller(p) = &opts.wait.mode {
            p.serve(&core);
        }
        let mut kept: Vec<Box<dyn Send + Sync>> = Vec::new();
        if let Some(shared) = &opts.shared_receive {
            // The queue and its memory outlive the QP (dropped after it).
            kept.push(Box::new(shared.keepalive()));
        }
        tracing::debug!(
            target: "mralloc::transfer",
            qpn = qp.qpn(),
            peer_qpn = peer.qpn,
            send_depth = opts.qp.send_depth,
            recv_depth = opts.qp.recv_depth,
            mode = ?mode,
            "connection established"
        );
        Ok(Connection {
            qp: ManuallyDrop::new(qp),
            pd: pd.clone(),
            peer,
            peer_blob,
            peer_grants: peer_grants.remote_only(),
            peer_addr: None,
            opts,
            core,
            scratch: Mutex::new(scratch),
            watch: None,
            kept,
            link,
            pair_peer: None,
            windows: Arc::new(Windows::new()),
            read_sge,
        })
    }

    /// Two connections in `pd` connected to each other on one device (loopback): what a single
    /// process needs to exercise both sides. Both get `opts`,
    /// [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access) included: a pair
    /// whose ends RDMA WRITE, READ or use atomics on each other's memory must ask for those rights.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if a verbs call fails: creating a completion channel, CQ or queue pair,
    ///   connecting it, or registering the connection's landing buffer for atomics.
    /// - [`Error::NoActiveDevice`] or [`Error::NoSuchIndex`] if
    ///   [`DeviceChoice::port`](crate::transfer::DeviceChoice::port) or
    ///   [`DeviceChoice::gid_index`](crate::transfer::DeviceChoice::gid_index) (or, unset, their
    ///   defaults) do not fit `pd`'s device.
    /// - [`Error::InvalidArgument`] if a queue depth is too large for a CQ (above `i32::MAX`).
    /// - [`Error::Io`] if mapping the landing buffer fails.
    pub fn pair(pd: &Pd, opts: &Options) -> Result<(Connection, Connection)> {
        let (a, b) = Connection::pair_with(pd, opts, false)?;
        Ok((a.into_blocking(), b.into_blocking()))
    }

    /// The PD local memory must be registered in.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// How many scatter entries an RDMA READ may have on this connection (see `read_sge`).
    pub(crate) fn max_read_sge(&self) -> u32 {
        self.read_sge
    }

    /// The memory windows bound through this connection (see `transfer::exact`).
    pub(crate) fn windows(&self) -> &Arc<Windows> {
        &self.windows
    }

    /// The completion engine: routing, parking, waiting.
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    /// The landing word of blocking atomics.
    pub(crate) fn scratch(&self) -> &Mutex<RegisteredBuf> {
        &self.scratch
    }

    /// Keeps `x` (a TCP stream, RDMA CM objects) until the connection is dropped, after its QP.
    pub(crate) fn keep(&mut self, x: impl Send + Sync + 'static) {
        self.kept.push(Box::new(x));
    }

    /// Fault injection: a connection that believes its queues are other than they are.
    #[cfg(test)]
    pub(crate) fn options_mut(&mut self) -> &mut Options {
        &mut self.opts
    }

    /// Starts the connection watcher on this connection and on `control`, the control channel
    /// set up with it (the async front end keeps that one): the device's events, and `source`
    /// (its setup TCP stream or CM channel, which the connection must own) if it has one. Call
    /// once setup is complete.
    pub(crate) fn start_watch(&mut self, source: Option<Source>, control: Option<&Connection>) -> Result<()> {
        let mut links = vec![self.link.clone()];
        links.extend(control.map(|c| c.link.clone()));
        self.watch = Some(watch(self.pd.context(), links, source)?);
        Ok(())
    }

    /// Makes two ends of a pair tell each other when one goes away.
    pub(crate) fn tie(a: &mut Connection, b: &mut Connection) {
        a.pair_peer = Some(Arc::downgrade(&b.link));
        b.pair_peer = Some(Arc::downgrade(&a.link));
    }

    /// The peer's endpoint.
    pub fn peer(&self) -> &Endpoint {
        &self.peer
    }

    /// The peer's buffer `desc` as reached over this connection: the key of the peer's device at
    /// this connection's far end ([`crate::RemoteDesc::for_peer`] with [`Connection::peer`]).
    ///
    /// # Errors
    /// [`Error::NoKeyForDevice`] if `desc` has no key for that device.
    pub fn remote_of(&self, desc: &crate::RemoteDesc) -> Result<crate::RemoteBuf> {
        desc.for_peer(&self.peer)
    }

    /// The application blob the peer sent while connecting (e.g. an encoded
    /// [`crate::RemoteBuf`]); empty if none.
    pub fn peer_blob(&self) -> &[u8] {
        &self.peer_blob
    }

    /// What the peer lets this side do into its memory through the connection: the remote
    /// rights its queue pair grants ([`Access::REMOTE_WRITE`], [`Access::REMOTE_READ`],
    /// [`Access::REMOTE_ATOMIC`]), as its setup message announced them — the peer's
    /// [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access), plus `REMOTE_WRITE` if it set [`Options::keepalive`] (its
    /// probes need it). A one-sided request the peer did not grant is refused here, before it
    /// is posted, with [`Error::NotGranted`]. The memory a request names must grant the right
    /// as well (its key): these rights are necessary, not sufficient.
    pub fn peer_grants(&self) -> Access {
        self.peer_grants
    }

    /// The peer's IP address and port as the setup saw it: the other end of the TCP stream
    /// ([`crate::transfer::Listener`], [`Connection::connect`]) or the RDMA CM peer address
    /// ([`crate::transfer::CmListener`], [`Connection::connect_cm`]); `None` for a
    /// [`Connection::pair`]. For logs and access control: the peer's RDMA endpoint is
    /// [`Connection::peer`].
    pub fn peer_addr(&self) -> Option<std::net::SocketAddr> {
        self.peer_addr
    }

    /// Records where the peer is (setup).
    pub(crate) fn set_peer_addr(&mut self, addr: Option<std::net::SocketAddr>) {
        self.peer_addr = addr;
    }

    /// The queue pair (for inspection).
    pub fn qp(&self) -> &Qp {
        &self.qp
    }

    /// The options in force (queue depths as granted by the device).
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// The error that failed the connection, if any.
    pub fn error(&self) -> Option<Error> {
        self.core.failure().map(Failure::error)
    }

    /// A snapshot of the connection's counters: requests and bytes posted, completions, failed
    /// completions, requests in flight.
    ///
    /// ```no_run
    /// # fn f(conn: &mralloc::transfer::Connection, buf: &mralloc::Buffer, to: &mralloc::RemoteBuf) -> mralloc::Result<()> {
    /// conn.write(&buf[..], to, 0)?;
    /// let s = conn.stats();
    /// assert_eq!((s.send_requests, s.send_bytes, s.errors), (1, buf.len() as u64, 0));
    /// # Ok(()) }
    /// ```
    ///
    /// In a fork()ed child the connection is the parent's: all zero (the counters' locks may
    /// have been held by a parent thread at the fork).
    pub fn stats(&self) -> ConnectionStats {
        if self.usable().is_err() {
            return ConnectionStats::default();
        }
        self.core.stats()
    }

    /// Reaps whatever completions have arrived, without waiting: waiters find their outcomes,
    /// and buffers of dropped operations ([`crate::transfer::Pending`]) whose completion arrived
    /// are freed. Returns how many completions were reaped. (Every operation and wait does this
    /// too; call it when a connection sits idle with parked buffers.)
    ///
    /// # Errors
    /// [`Error::Verbs`] if polling a CQ fails; the connection is failed then.
    /// [`Error::Forked`] in a fork()ed child of the process that made the connection.
    pub fn progress(&self) -> Result<usize> {
        self.usable()?;
        self.core.progress().inspect_err(|e| self.fail(Failure::local(e)))
    }

    /// [`Error::Forked`] in a fork()ed child of the process that made the connection: checked
    /// before any lock (a parent thread may have held one at the fork).
    #[inline(always)]
    pub(crate) fn usable(&self) -> Result<()> {
        self.qp.born().check("this connection")
    }

    /// Whether this is a fork()ed child's copy of a parent's connection (see [`Connection`]).
    pub(crate) fn forked_copy(&self) -> bool {
        !self.qp.born().here()
    }

    pub(crate) fn check(&self) -> Result<()> {
        self.usable()?;
        match self.core.failure() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }
}
