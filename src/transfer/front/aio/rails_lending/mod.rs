//! Remote memory over a rail group ([`crate::transfer::AsyncRails`]): one buffer lent through
//! every rail at once.
//!
//! The lender binds a key per live rail — a window through that rail's connection, over the
//! one buffer — and keeps each in that rail's own registry ([`super::lending::Lending`]) with a
//! share of the buffer ([`Kept::Shared`]): a rail that fails frees its key's share once its queue
//! pair is flushed, as a single connection frees what it lent, while the other rails' keys keep
//! working; the buffer is freed with the last share. The borrower's handle
//! ([`RailsRemoteMemory`]) gathers the keys in one [`RemoteDesc`] — each matched to the rail
//! whose connection it names (the lender's end's GID and queue pair number) — and gives each back
//! on its own rail when dropped (`borrow`).

mod borrow;

pub use borrow::RailsRemoteMemory;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio::sync::mpsc::{channel, Receiver, Sender};

use crate::error::{Error, RemoteRefusal, Result};
use crate::heap::{Buffer, Heap};
use crate::transfer::engine::completion::Failure;
use crate::transfer::front::aio::control::{ControlShared, Group, RailsGrant, PEER_TIMEOUT};
use crate::transfer::front::aio::lending::{
    check_lending_heap, lend, probe_windows, unlend, Held, Kept, RemoteLimits, RemoteMemoryStats,
};
use crate::transfer::front::aio::wire::{Msg, RailKey, RailKeys, MAX_KEYS};
use crate::transfer::front::aio::{AsyncConnection, Shared};
use crate::transfer::grant::failed_itself;
use crate::transfer::Rejected;
use crate::verbs::Access;

/// Bound on pushed memory the application has not taken yet: a peer beyond it breaks the
/// protocol (the rail it pushed on is failed).
const PUSHED_INBOX: usize = 1024;
/// Most of the peer's requests being served or waiting to be at once; more are refused.
const MAX_SERVING: usize = 64;

/// A rail group's remote memory: its rails, what it lends from, what the peer pushed. Each
/// rail's control channel holds it ([`ControlShared::set_group`]); the group's handle too.
pub(crate) struct RailsLending {
    ends: Mutex<Vec<End>>,
    serving: Mutex<Option<(Heap, RemoteLimits)>>,
    /// One request served at a time (each checks the limits before it lends).
    gate: tokio::sync::Semaphore,
    /// Requests being served or waiting for the gate.
    requests: AtomicUsize,
    pushed_tx: Sender<(u64, RailsRemoteMemory)>,
    pushed_rx: tokio::sync::Mutex<Receiver<(u64, RailsRemoteMemory)>>,
    held: Arc<Held>,
    /// Whether the runtime has timers (a bind's deadline).
    timers: bool,
}

/// One rail, weakly (the control channel that holds the group belongs to it).
struct End {
    data: Weak<Shared>,
    /// Keys of this side's [`RailsRemoteMemory`] handles on the rail: the peer's key would be
    /// used on a new connection put in its place, so the rail is not restored while any live.
    keys: Arc<AtomicUsize>,
}

/// Where a key lent over the group is: its rail's connection and its handle there.
type Placed = (Weak<Shared>, u64);

/// A rail that lives, with its control channel.
struct Live {
    at: usize,
    sh: Arc<Shared>,
    cs: Arc<ControlShared>,
}

impl RailsLending {
    /// The group of `conns`, rail `i` being `conns[i]`, lending from `serving` from the start
    /// (checked by the caller); set on each one's control channel.
    pub(crate) fn new(conns: &[AsyncConnection], serving: Option<(Heap, RemoteLimits)>) -> Arc<RailsLending> {
        let (pushed_tx, pushed_rx) = channel(PUSHED_INBOX);
        let group = Arc::new(RailsLending {
            ends: Mutex::new(conns.iter().map(End::of).collect()),
            serving: Mutex::new(serving),
            gate: tokio::sync::Semaphore::new(1),
            requests: AtomicUsize::new(0),
            pushed_tx,
            pushed_rx: tokio::sync::Mutex::new(pushed_rx),
            held: Arc::new(Held::default()),
            timers: crate::transfer::front::aio::reactor::has_timers(),
        });
        for c in conns {
            group.install(c);
        }
        group
    }

    fn install(self: &Arc<Self>, conn: &AsyncConnection) {
        if let Some(cs) = &conn.shared.control {
            cs.set_group(self.clone());
        }
    }

    /// Puts `conn` in rail `i`'s place if `replace` (the group's own restore) succeeds, and
    /// nothing refuses it first.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] while a handle of this side holds a key on rail `i`, or if
    /// the heap lent from is not bound to `conn`'s PD; `replace`'s.
    pub(crate) fn restore(
        self: &Arc<Self>,
        i: usize,
        conn: &AsyncConnection,
        replace: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        // Held across: a handle made meanwhile counts its keys under this lock.
        let mut ends = self.ends.lock();
        if let Some(n @ 1..) = ends.get(i).map(|e| e.keys.load(Ordering::Relaxed)) {
            return Err(Error::InvalidArgument(format!(
                "rail {i} carries keys of {n} live RailsRemoteMemory handles: drop them first"
            )));
        }
        if let Some((heap, _)) = &*self.serving.lock() {
            check_lending_heap(heap, conn.pd())?;
        }
        replace()?;
        if let Some(e) = ends.get_mut(i) {
            *e = End::of(conn);
        }
        drop(ends);
        self.install(conn);
        Ok(())
    }

    /// Lends from `heap` within `limits` (per rail) from now on.
    ///
    /// # Errors
    /// [`Error::NoControlChannel`] if a rail has none; [`Error::InvalidArgument`] if `heap` was
    /// not built with [`Access::MW_BIND`] or is not bound to a rail's PD.
    pub(crate) fn set_serving(&self, heap: &Heap, limits: RemoteLimits) -> Result<()> {
        let ends: Vec<Weak<Shared>> = self.ends.lock().iter().map(|e| e.data.clone()).collect();
        for sh in ends.iter().filter_map(Weak::upgrade) {
            if sh.control.is_none() {
                return Err(Error::NoControlChannel);
            }
            check_lending_heap(heap, sh.conn().pd())?;
        }
        *self.serving.lock() = Some((heap.clone(), limits));
        Ok(())
    }

    /// The rails that live (their connection and control channel), and why the others do not.
    fn live(&self) -> (Vec<Live>, Vec<String>) {
        let ends: Vec<Weak<Shared>> = self.ends.lock().iter().map(|e| e.data.clone()).collect();
        let (mut live, mut down) = (Vec::new(), Vec::new());
        for (at, data) in ends.into_iter().enumerate() {
            let Some(sh) = data.upgrade() else {
                down.push(format!("rail {at}: closed"));
                continue;
            };
            match (sh.conn().error(), sh.control.clone()) {
                (Some(e), _) => down.push(format!("rail {at}: {e}")),
                (None, None) => down.push(format!("rail {at}: {}", Error::NoControlChannel)),
                (None, Some(cs)) if cs.is_dead() => down.push(format!("rail {at}: its control channel is gone")),
                (None, Some(cs)) => live.push(Live { at, sh, cs }),
            }
        }
        (live, down)
    }

    /// The rail requests and pushes go on: the first that lives.
    fn messages(&self) -> Result<Live> {
        let (live, failures) = self.live();
        live.into_iter().next().ok_or(Error::RailsDown { failures })
    }

    /// What this side lends (every rail's registry: a buffer lent over `n` rails counts `n`
    /// times) and holds over the group.
    pub(crate) fn stats(&self) -> RemoteMemoryStats {
        let mut s = RemoteMemoryStats::default();
        for l in self.live().0 {
            let (buffers, bytes, total) = l.cs.lent();
            s.lent_buffers += buffers;
            s.lent_bytes += bytes;
            s.lent_total += total;
        }
        (s.held_buffers, s.held_bytes) = self.held.now();
        s
    }

    /// The owner's answer to a request for `len` bytes with `access` over the group, and where
    /// the keys it grants are.
    async fn answer(&self, seq: u64, len: u64, access: Access) -> (Msg, Vec<Placed>) {
        let refuse = |code, limit| (Msg::Refused { seq, code, limit }, Vec::new());
        let Some((heap, limits)) = self.serving.lock().clone() else {
            return refuse(RemoteRefusal::NotServing, 0);
        };
        if len > limits.max_request {
            return refuse(RemoteRefusal::TooLarge, limits.max_request);
        }
        if !heap.access().contains(Access::MW_BIND) {
            return refuse(RemoteRefusal::Rights, 0);
        }
        for l in self.live().0 {
            if !l.sh.conn().options().qp.remote_access.contains(access) {
                return refuse(RemoteRefusal::Rights, 0);
            }
            if let Err(left) = l.cs.room(len, &limits) {
                return refuse(RemoteRefusal::LimitReached, left);
            }
        }
        // Zeroed: the peer must not read what this heap's earlier owners left.
        let Ok(buf) =
            usize::try_from(len).map_err(|_| Error::InvalidArgument(String::new())).and_then(|n| heap.alloc_zeroed(n))
        else {
            return refuse(RemoteRefusal::OutOfMemory, 0);
        };
        match self.lend(buf, access).await {
            Ok((addr, len, keys, placed)) => (Msg::RailsGranted { seq, addr, len, keys }, placed),
            Err(_) => refuse(RemoteRefusal::Unavailable, 0),
        }
    }

    /// Lends `buf` with `access` through every live rail: a key per rail, each in its rail's
    /// registry and announced (the peer may release it from now on). Returns the buffer's
    /// address and length, the keys, and where each is. A rail that dies before its bind, or
    /// fails under it by something else (its bind flushed, the connection closed), gets no
    /// key; so does one whose bind does not complete within [`PEER_TIMEOUT`] (a send queue
    /// stuck behind a SEND the peer never receives): that rail is failed. Any other failure
    /// withdraws the keys made.
    ///
    /// # Errors
    /// With the buffer back (`None` if a key could not be shown dead: its rail's connection
    /// keeps its share until it goes, or it is leaked): [`Error::RailsDown`] if no rail lives;
    /// [`Error::InvalidArgument`] for rights a live rail's queue pair does not admit, two rails
    /// whose ends present one GID, a zero GID, or as a single connection's lending; a bind's
    /// failure, as `AsyncConnection::push`.
    async fn lend(
        &self,
        buf: Buffer,
        access: Access,
    ) -> std::result::Result<(u64, u64, RailKeys, Vec<Placed>), Rejected<Buffer>> {
        let (live, mut down) = self.live();
        let mut failed = if live.len() > MAX_KEYS {
            Some(Error::InvalidArgument(format!("{} live rails, a descriptor carries {MAX_KEYS} keys", live.len())))
        } else {
            live.iter().find(|l| !l.sh.conn().options().qp.remote_access.contains(access)).map(|l| {
                Error::InvalidArgument(format!(
                    "rail {}'s QpOptions::remote_access does not admit the rights lent",
                    l.at
                ))
            })
        };
        let share = Arc::new(Mutex::new(buf));
        let (addr, len) = Kept::Shared(share.clone()).range();
        let (addr, len) = (addr as u64, len as u64);
        let mut made: Vec<(&Live, RailKey)> = Vec::with_capacity(live.len());
        for l in &live {
            if failed.is_some() {
                break;
            }
            // The GID the peer's end addresses this one by (an RDMA CM connection's from its route).
            let gid = match l.sh.conn().qp().local_gid() {
                Ok(gid) if gid.is_zero() => Err(Error::InvalidArgument(format!("rail {} has no GID to key by", l.at))),
                r => r,
            };
            let gid = match gid {
                Ok(gid) => gid,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            if let Some((other, _)) = made.iter().find(|(_, k)| k.gid() == gid) {
                let why =
                    format!("rails {} and {} present one GID ({gid}): lending needs a device per rail", other.at, l.at);
                failed = Some(Error::InvalidArgument(why));
                break;
            }
            probe_windows(&l.sh).await;
            let lived = l.sh.conn().error().is_none();
            let qpn = l.sh.conn().qp().qpn();
            let bound = lend(l.cs.lending(), &l.sh, Kept::Shared(share.clone()), access);
            let bound = if self.timers {
                tokio::time::timeout(PEER_TIMEOUT, bound).await.unwrap_or_else(|_| {
                    // Failed: its flush ends the bind, and the connection's failure path frees the
                    // entry the dropped bind left (its share with it).
                    let error = Error::Timeout(PEER_TIMEOUT, "a memory window's bind");
                    l.sh.conn().fail(Failure::local(&error));
                    Err(Rejected { error, buf: None })
                })
            } else {
                bound.await
            };
            match bound {
                Ok((handle, remote)) => made.push((l, RailKey::new(gid, qpn, remote.rkey, handle))),
                // The rail died before the bind, or failed under it by something else: the peer
                // cannot use it either. Its share, if it kept one, goes with its flush.
                Err(Rejected { error, .. }) if l.sh.conn().error().is_some() && (!lived || rails_fault(&error)) => {
                    down.push(format!("rail {}: {error}", l.at));
                }
                Err(Rejected { error, .. }) => failed = Some(error),
            }
        }
        let keys: Vec<RailKey> = made.iter().map(|(_, k)| *k).collect();
        let failed =
            failed.or_else(|| keys.is_empty().then(|| Error::RailsDown { failures: std::mem::take(&mut down) }));
        match (failed, RailKeys::new(&keys)) {
            (None, Some(keys)) => {
                for (l, k) in &made {
                    l.cs.announce(k.handle());
                }
                let placed = made.iter().map(|(l, k)| (Arc::downgrade(&l.sh), k.handle())).collect();
                Ok((addr, len, keys, placed))
            }
            (failed, _) => {
                for (l, k) in made {
                    // Dropped: a share that came back; one that did not stays with its rail.
                    drop(unlend(l.cs.lending(), &l.sh, k.handle(), false).await);
                }
                let error = failed.unwrap_or_else(|| Error::InvalidArgument("no key to lend by".into()));
                let buf = Arc::try_unwrap(share).ok().map(Mutex::into_inner);
                Err(Rejected { error, buf })
            }
        }
    }

    /// Withdraws the keys `placed` (lent and announced, but the peer was never told), each on
    /// its rail; the buffer back if every share came home.
    async fn withdraw(placed: Vec<Placed>) -> Option<Buffer> {
        let mut share = None;
        for (data, handle) in placed {
            let Some(sh) = data.upgrade() else { continue };
            let Some(cs) = sh.control.clone() else { continue };
            if let Some(Kept::Shared(s)) = unlend(cs.lending(), &sh, handle, true).await {
                share = Some(s);
            }
        }
        share.and_then(|s| Arc::try_unwrap(s).ok()).map(Mutex::into_inner)
    }

    /// Lends `buf` over the group unasked and tells the peer on the first live rail, in a task
    /// of its own: a cancelled caller does not cut it short (what was lent is announced to the
    /// peer, or withdrawn).
    pub(crate) async fn push(
        self: &Arc<Self>,
        buf: Buffer,
        access: Access,
        tag: u64,
    ) -> std::result::Result<(), Rejected<Buffer>> {
        let Some(bits) = super::lending::access_bits(access) else {
            let error = Error::InvalidArgument("a push grants remote read and/or write rights".into());
            return Err(Rejected { error, buf: Some(buf) });
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let error = Error::Io {
                what: "pushing memory over rails".into(),
                source: std::io::Error::other("not inside a tokio runtime"),
            };
            return Err(Rejected { error, buf: Some(buf) });
        };
        let group = self.clone();
        let task = runtime.spawn(async move {
            let (addr, len, keys, placed) = group.lend(buf, access).await?;
            let sent = group.messages().and_then(|l| l.cs.tell(Msg::RailsPush { addr, len, access: bits, tag, keys }));
            match sent {
                Ok(()) => Ok(()),
                // Nobody was told: every key is withdrawn (those on rails that went are freed with them).
                Err(error) => Err(Rejected { error, buf: RailsLending::withdraw(placed).await }),
            }
        });
        match task.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime shut down under it: what it lent goes with the connections.
            Err(_) => Err(Rejected { error: Error::Closed, buf: None }),
        }
    }
}

impl Group for RailsLending {
    fn serve(self: Arc<Self>, seq: u64, len: u64, access: Access, on: Arc<ControlShared>) {
        if self.requests.fetch_add(1, Ordering::AcqRel) >= MAX_SERVING {
            self.requests.fetch_sub(1, Ordering::AcqRel);
            let _ = on.tell(Msg::Refused { seq, code: RemoteRefusal::Unavailable, limit: 0 });
            return;
        }
        // A task of its own: its binds wait on the other rails, whose slowness must not stall
        // the control channel the request came on.
        tokio::spawn(async move {
            let (answer, placed) = match self.gate.acquire().await {
                Ok(_one) => self.answer(seq, len, access).await,
                Err(_) => (Msg::Refused { seq, code: RemoteRefusal::Unavailable, limit: 0 }, Vec::new()),
            };
            self.requests.fetch_sub(1, Ordering::AcqRel);
            if on.tell(answer).is_err() {
                // The request's rail is gone before the answer left: nobody will release it.
                drop(RailsLending::withdraw(placed).await);
            }
        });
    }

    fn pushed(&self, tag: u64, (addr, len, keys): RailsGrant, access: Access) -> Result<()> {
        let mem = self.held(addr, len, access, &keys)?;
        match self.pushed_tx.try_send((tag, mem)) {
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => Err(Error::Protocol(format!(
                "control channel: more than {PUSHED_INBOX} pushes over rails not taken by the application"
            ))),
            _ => Ok(()),
        }
    }

    fn give_back(&self, (addr, len, keys): RailsGrant) {
        // Made and dropped: each key it matched goes back on its rail.
        drop(self.held(addr, len, Access::NONE, &keys));
    }
}

impl End {
    fn of(conn: &AsyncConnection) -> End {
        End { data: Arc::downgrade(&conn.shared), keys: Arc::new(AtomicUsize::new(0)) }
    }
}

/// Whether `error`, from a bind on a rail that failed, is the rail's failure rather than the
/// bind's own: the connection closed or timed out, or the bind was flushed.
fn rails_fault(error: &Error) -> bool {
    match error {
        Error::Operation { .. } => !failed_itself(error, None),
        Error::Closed | Error::Timeout(..) | Error::FlushLost { .. } | Error::DeviceRemoved { .. } => true,
        _ => false,
    }
}
