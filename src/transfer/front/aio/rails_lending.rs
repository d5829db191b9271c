//! Remote memory over a rail group ([`crate::transfer::AsyncRails`]): one buffer lent through
//! every rail at once, and the borrower's handle, [`RailsRemoteMemory`].
//!
//! The lender binds a key per live rail — a window through that rail's connection, over the
//! one buffer — and keeps each in that rail's own registry ([`super::lending::Lending`]) with a
//! share of the buffer ([`Kept::Shared`]): a rail that fails frees its key's share once its queue
//! pair is flushed, as a single connection frees what it lent, while the other rails' keys keep
//! working; the buffer is freed with the last share. The borrower's handle gathers the keys in
//! one [`RemoteDesc`] (each under the GID of the lender's end of its rail, which the borrower's
//! end of that rail addresses) and gives each back on its own rail when dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio::sync::mpsc::{channel, Receiver, Sender, UnboundedSender};
use tokio::sync::oneshot;

use crate::error::{Error, RemoteRefusal, Result};
use crate::heap::{Buffer, Heap};
use crate::remote_desc::{DeviceKey, RemoteDesc};
use crate::transfer::front::aio::control::{ControlShared, Group, RailsGrant, KEEPALIVE};
use crate::transfer::front::aio::lending::{check_lending_heap, lend, unlend, Held, Kept, RemoteLimits};
use crate::transfer::front::aio::wire::{Msg, RailKey, RailKeys, MAX_KEYS};
use crate::transfer::front::aio::{AsyncConnection, Shared};
use crate::transfer::Rejected;
use crate::verbs::{Access, WcStatus};

/// Bound on pushed memory the application has not taken yet: a peer beyond it breaks the
/// protocol (the rail it pushed on is failed).
const PUSHED_INBOX: usize = 1024;

/// A rail group's remote memory: its rails, what it lends from, what the peer pushed. Each
/// rail's control channel holds it ([`ControlShared::set_group`]); the group's handle too.
pub(crate) struct RailsLending {
    ends: Mutex<Vec<End>>,
    serving: Mutex<Option<(Heap, RemoteLimits)>>,
    pushed_tx: Sender<(u64, RailsRemoteMemory)>,
    pushed_rx: tokio::sync::Mutex<Receiver<(u64, RailsRemoteMemory)>>,
    held: Arc<Held>,
}

/// One rail, weakly (the control channel that holds the group belongs to it).
struct End {
    data: Weak<Shared>,
    /// Keys of this side's [`RailsRemoteMemory`] handles on the rail: the peer's key would be
    /// used on a new connection put in its place, so the rail is not restored while any live.
    keys: Arc<AtomicUsize>,
}

/// A rail that lives, with its control channel.
struct Live {
    at: usize,
    sh: Arc<Shared>,
    cs: Arc<ControlShared>,
}

impl RailsLending {
    /// The group of `conns`, rail `i` being `conns[i]`; set on each one's control channel.
    pub(crate) fn new(conns: &[AsyncConnection]) -> Arc<RailsLending> {
        let (pushed_tx, pushed_rx) = channel(PUSHED_INBOX);
        let ends = conns.iter().map(End::of).collect();
        let group = Arc::new(RailsLending {
            ends: Mutex::new(ends),
            serving: Mutex::new(None),
            pushed_tx,
            pushed_rx: tokio::sync::Mutex::new(pushed_rx),
            held: Arc::new(Held::default()),
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

    /// Whether rail `i` may be replaced: no handle of this side holds a key on it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming how many do.
    pub(crate) fn check_restore(&self, i: usize) -> Result<()> {
        match self.ends.lock().get(i).map(|e| e.keys.load(Ordering::Relaxed)) {
            Some(n @ 1..) => Err(Error::InvalidArgument(format!(
                "rail {i} carries keys of {n} live RailsRemoteMemory handles: drop them first"
            ))),
            _ => Ok(()),
        }
    }

    /// Puts `conn` in rail `i`'s place (after [`RailsLending::check_restore`]).
    pub(crate) fn replace(self: &Arc<Self>, i: usize, conn: &AsyncConnection) {
        if let Some(e) = self.ends.lock().get_mut(i) {
            *e = End::of(conn);
        }
        self.install(conn);
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

    /// The rail requests go on: the first that lives.
    fn messages(&self) -> Result<Live> {
        let (live, failures) = self.live();
        live.into_iter().next().ok_or(Error::RailsDown { failures })
    }

    /// The owner's answer to a request for `len` bytes with `access` over the group.
    async fn answer(&self, seq: u64, len: u64, access: Access) -> Msg {
        let refuse = |code, limit| Msg::Refused { seq, code, limit };
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
            Ok((addr, len, keys)) => Msg::RailsGranted { seq, addr, len, keys },
            Err(_) => refuse(RemoteRefusal::Unavailable, 0),
        }
    }

    /// Lends `buf` with `access` through every live rail: a key per rail, each in its rail's
    /// registry and announced (the peer may release it from now on). Returns the buffer's
    /// address and length and the keys. A rail that failed under its bind (by something else:
    /// its bind was flushed) gets no key; any other failure withdraws the keys made.
    ///
    /// # Errors
    /// With the buffer back (`None` if a withdrawn key could not be shown dead: that rail's
    /// connection keeps its share until it goes, or it is leaked): [`Error::RailsDown`] if no
    /// rail lives; [`Error::InvalidArgument`] for rights a live rail's queue pair does not
    /// admit, two rails whose ends present one GID, or as a single connection's lending; a
    /// bind's failure, as `AsyncConnection::push`.
    pub(crate) async fn lend(
        &self,
        buf: Buffer,
        access: Access,
    ) -> std::result::Result<(u64, u64, RailKeys), Rejected<Buffer>> {
        let (live, mut down) = self.live();
        let mut failed = None;
        if live.len() > MAX_KEYS {
            failed = Some(Error::InvalidArgument(format!(
                "{} live rails, a descriptor carries {MAX_KEYS} keys",
                live.len()
            )));
        } else if let Some(l) = live.iter().find(|l| !l.sh.conn().options().qp.remote_access.contains(access)) {
            failed = Some(Error::InvalidArgument(format!(
                "rail {}'s QpOptions::remote_access does not admit the rights lent",
                l.at
            )));
        }
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
                Ok(gid) => gid,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            if let Some((other, _)) = made.iter().find(|(_, k)| k.gid == gid) {
                let why =
                    format!("rails {} and {} present one GID ({gid}): lending needs a device per rail", other.at, l.at);
                failed = Some(Error::InvalidArgument(why));
                break;
            }
            let lived = l.sh.conn().error().is_none();
            match lend(l.cs.lending(), &l.sh, Kept::Shared(share.clone()), access).await {
                Ok((handle, remote)) => made.push((l, RailKey { gid, rkey: remote.rkey, handle })),
                // The rail failed under the bind by something else (it was flushed, or refused
                // with that failure), and the share is back: the peer cannot use that rail either.
                Err(Rejected { error, buf: Some(_) }) if l.sh.conn().error().is_some() && !own(&error, lived) => {
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
                    l.cs.announce(k.handle);
                }
                Ok((addr, len, keys))
            }
            (failed, _) => {
                for (l, k) in made {
                    // Dropped: a share that came back; one that did not stays with its rail.
                    drop(unlend(l.cs.lending(), &l.sh, k.handle, false).await);
                }
                let error = failed.unwrap_or_else(|| Error::Protocol("rail keys without a key".into()));
                let buf = Arc::try_unwrap(share).ok().map(Mutex::into_inner);
                Err(Rejected { error, buf })
            }
        }
    }

    /// The borrower's handle on memory the peer lent over the group: `keys` matched to the
    /// rails whose peer end presents their GIDs (a key for no rail of the group is left to its
    /// owner, who frees it when that connection goes).
    ///
    /// # Errors
    /// [`Error::Protocol`] if no key is for a rail of the group (the others are given back).
    pub(crate) fn held(&self, addr: u64, len: u64, access: Access, keys: &RailKeys) -> Result<RailsRemoteMemory> {
        let ends: Vec<(Weak<Shared>, Arc<AtomicUsize>)> =
            self.ends.lock().iter().map(|e| (e.data.clone(), e.keys.clone())).collect();
        let mut mem = RailsRemoteMemory { desc: None, access, keys: Vec::new(), held: None, len };
        let mut found = Vec::new();
        for k in keys.as_slice() {
            let rail = ends.iter().enumerate().find_map(|(i, (data, count))| {
                let sh = data.upgrade()?;
                let out = sh.control.as_ref()?.out.clone();
                (sh.conn().peer().gid == k.gid).then(|| (i, out, count.clone()))
            });
            match rail {
                Some((rail, out, count)) => {
                    count.fetch_add(1, Ordering::Relaxed);
                    mem.keys.push(HeldKey { rail, out, handle: k.handle, count });
                    found.push(DeviceKey { gid: k.gid, rkey: k.rkey });
                }
                None => tracing::debug!("remote memory over rails: a key for {} reaches no rail of this group", k.gid),
            }
        }
        if found.is_empty() {
            return Err(Error::Protocol(
                "control channel: memory over rails with a key for no rail of this group".into(),
            ));
        }
        mem.desc = Some(RemoteDesc::new(addr, len, &found)?);
        self.held.buffers.fetch_add(1, Ordering::Relaxed);
        self.held.bytes.fetch_add(len, Ordering::Relaxed);
        mem.held = Some(self.held.clone());
        Ok(mem)
    }

    /// The next memory the peer pushed over the group, with its tag.
    ///
    /// # Errors
    /// [`Error::RailsDown`] once no rail lives and nothing is queued.
    pub(crate) async fn pushed(&self) -> Result<(u64, RailsRemoteMemory)> {
        let mut rx = self.pushed_rx.lock().await;
        let timers = super::reactor::has_timers();
        loop {
            if let Ok(got) = rx.try_recv() {
                return Ok(got);
            }
            let (live, failures) = self.live();
            if live.is_empty() {
                return Err(Error::RailsDown { failures });
            }
            drop(live);
            if !timers {
                return rx.recv().await.ok_or(Error::Closed);
            }
            // Checked again at every keepalive: the rails may all die meanwhile.
            if let Ok(got) = tokio::time::timeout(KEEPALIVE, rx.recv()).await {
                return got.ok_or(Error::Closed);
            }
        }
    }

    /// Asks the peer for `len` bytes with `access` over the group, on the first live rail.
    pub(crate) fn request(
        self: &Arc<Self>,
        len: u64,
        access: Access,
    ) -> impl Future<Output = Result<RailsRemoteMemory>> + Send + 'static {
        let (tx, rx) = oneshot::channel();
        let group = self.clone();
        // Run by the request rail's control task: a handle nobody takes any more (a cancelled
        // request) is dropped, so given back.
        let reply = Box::new(move |answer: Result<RailsGrant>| {
            let _ = tx.send(answer.and_then(|(addr, len, keys)| group.held(addr, len, access, &keys)));
        });
        let started = self.messages().and_then(|l| {
            l.cs.request_rails(len, access, reply)?;
            Ok((l.sh.clone(), rx))
        });
        async move {
            let (sh, rx) = started?;
            match rx.await {
                Ok(answer) => answer,
                Err(_) => Err(sh.conn().error().unwrap_or(Error::Closed)),
            }
        }
    }

    /// Lends `buf` over the group unasked, and tells the peer on the first live rail.
    pub(crate) async fn push(
        &self,
        buf: Buffer,
        access: Access,
        tag: u64,
    ) -> std::result::Result<(), Rejected<Buffer>> {
        let Some(bits) = super::lending::access_bits(access) else {
            let error = Error::InvalidArgument("a push grants remote read and/or write rights".into());
            return Err(Rejected { error, buf: Some(buf) });
        };
        let (addr, len, keys) = self.lend(buf, access).await?;
        let sent = self.messages().and_then(|l| {
            l.cs.out.send(Msg::RailsPush { addr, len, access: bits, tag, keys }).map_err(|_| Error::Closed)
        });
        let Err(error) = sent else { return Ok(()) };
        // Nobody was told: every key is withdrawn (those on rails that went are freed with them).
        let (live, _) = self.live();
        let mut share = None;
        for l in &live {
            let Ok(gid) = l.sh.conn().qp().local_gid() else { continue };
            let Some(k) = keys.as_slice().iter().find(|k| k.gid == gid) else { continue };
            if let Some(Kept::Shared(s)) = unlend(l.cs.lending(), &l.sh, k.handle, true).await {
                share = Some(s);
            }
        }
        let buf = share.and_then(|s| Arc::try_unwrap(s).ok()).map(Mutex::into_inner);
        Err(Rejected { error, buf })
    }
}

impl Group for RailsLending {
    fn serve(&self, seq: u64, len: u64, access: Access) -> Pin<Box<dyn Future<Output = Msg> + Send + '_>> {
        Box::pin(self.answer(seq, len, access))
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

/// Whether a bind's failure is its own — refused when posted on a connection that lived, or
/// completed with an error that is no flush or timeout — rather than its connection's.
fn own(error: &Error, lived: bool) -> bool {
    match error {
        Error::Operation { status, .. } => !matches!(status, WcStatus::WrFlushErr | WcStatus::RespTimeoutErr),
        Error::Timeout(..) | Error::FlushLost { .. } => false,
        _ => lived,
    }
}

/// Memory of the peer's heap reachable through every rail of an
/// [`AsyncRails`](crate::transfer::AsyncRails) group, until the handle is dropped: requested
/// with [`AsyncRails::request_remote`](crate::transfer::AsyncRails::request_remote) or pushed
/// by the peer ([`AsyncRails::pushed`](crate::transfer::AsyncRails::pushed)). Its
/// [`RemoteDesc`] carries a key per rail (each working through that rail's connection only,
/// on exactly this memory): striped WRITEs and READs
/// ([`AsyncRails::write`](crate::transfer::AsyncRails::write)) use them all.
///
/// Dropping the handle tells the peer on every rail, which revokes each key and frees the
/// memory with the last. A rail that fails takes its key with it (the peer frees that key once
/// the rail's queue pair is flushed); the others keep working. While the handle lives, the
/// rails it has keys on are not [restored](crate::transfer::AsyncRails::restore): the peer's
/// new connection would be handed the old key.
pub struct RailsRemoteMemory {
    /// `None` only while being made.
    desc: Option<RemoteDesc>,
    len: u64,
    access: Access,
    keys: Vec<HeldKey>,
    held: Option<Arc<Held>>,
}

/// One rail's key of a handle: where to give it back.
struct HeldKey {
    rail: usize,
    out: UnboundedSender<Msg>,
    handle: u64,
    count: Arc<AtomicUsize>,
}

impl std::fmt::Debug for RailsRemoteMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailsRemoteMemory")
            .field("desc", &self.desc)
            .field("access", &self.access)
            .field("rails", &self.rails().collect::<Vec<_>>())
            .finish()
    }
}

impl RailsRemoteMemory {
    /// Address, length and a key per rail, for the group's transfers.
    pub fn desc(&self) -> RemoteDesc {
        self.desc.expect("a handle has its descriptor once made")
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true: remote memory is at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rights granted (remote read and/or write).
    pub fn access(&self) -> Access {
        self.access
    }

    /// The rails (the group's indexes) the memory has a key on.
    pub fn rails(&self) -> impl Iterator<Item = usize> + '_ {
        self.keys.iter().map(|k| k.rail)
    }
}

impl Drop for RailsRemoteMemory {
    fn drop(&mut self) {
        for k in self.keys.drain(..) {
            k.count.fetch_sub(1, Ordering::Relaxed);
            // A rail that is gone: the peer freed that key when it noticed.
            let _ = k.out.send(Msg::Release { handle: k.handle });
        }
        if let Some(held) = self.held.take() {
            held.buffers.fetch_sub(1, Ordering::Relaxed);
            held.bytes.fetch_sub(self.len, Ordering::Relaxed);
        }
    }
}
