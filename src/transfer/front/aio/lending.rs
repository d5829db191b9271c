//! Remote memory: what one side lends its peer (a registry of the buffers lent and their keys)
//! and what it holds of the peer's ([`RemoteMemory`] handles).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::{Error, Result};
use crate::heap::{Buffer, Heap};
use crate::remote::RemoteBuf;
use crate::transfer::exact::{grant_rights, Keyed};
use crate::transfer::front::aio::op::{NoBytes, Op};
use crate::transfer::front::aio::wire::{Msg, READ, WRITE};
use crate::transfer::front::aio::Shared;
use crate::transfer::request::iobuf::{IoBuf, IoBufMut};
use crate::transfer::Rejected;
use crate::verbs::{Access, Pd};

/// How much memory an [`crate::transfer::AsyncConnection`] lends its peer
/// ([`crate::transfer::AsyncConnection::serve_remote_memory`]); a request beyond them is refused
/// with [`crate::Error::RemoteRefused`] at the peer. A rail group
/// ([`crate::transfer::AsyncRails::serve_remote_memory`]) applies them to each rail: memory lent
/// over the group counts its whole length on every rail that has a key to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteLimits {
    /// Largest single request, in bytes (default 64 MiB; a request of exactly this many is
    /// granted).
    pub max_request: u64,
    /// Most bytes lent at once through the connection (default 256 MiB).
    pub max_bytes: u64,
    /// Most buffers lent at once through the connection (default 1024).
    pub max_buffers: usize,
}

impl Default for RemoteLimits {
    fn default() -> RemoteLimits {
        RemoteLimits { max_request: 64 << 20, max_bytes: 256 << 20, max_buffers: 1024 }
    }
}

/// Counts of remote memory on one connection
/// ([`crate::transfer::AsyncConnection::remote_memory_stats`]). More fields may come in later
/// versions (`#[non_exhaustive]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RemoteMemoryStats {
    /// Buffers of this side's heap the peer may access now (requested by it, or pushed).
    pub lent_buffers: usize,
    /// Their bytes.
    pub lent_bytes: u64,
    /// [`RemoteMemory`] handles of this side that are alive.
    pub held_buffers: u64,
    /// Their bytes.
    pub held_bytes: u64,
    /// Buffers lent to the peer since the connection was made (each grant and push it was
    /// told of).
    pub lent_total: u64,
}

/// Memory lent to the peer: the buffer and its key (a window bound through the connection,
/// over the heap chunk or an exact registration: see `transfer::exact`). An entry is dropped
/// only once the window was invalidated, or the QP is in the error state and flushed; dropping
/// it deallocates the window and deregisters an exact registration before the buffer is freed
/// (or leaks the buffer).
pub(crate) struct Lent {
    keyed: Keyed<Kept>,
    /// Whether the peer was told the handle (its bind completed): only then may the peer's
    /// messages release it. Before, the entry belongs to the bind in flight.
    announced: bool,
}

/// What keeps lent memory: the buffer, or (memory lent over a rail group, a key per rail) a
/// share of it — freed when the last rail's key is released. (The mutex only makes the share
/// `Send`: it is locked to take the buffer's address before any key exists, and the buffer is
/// unwrapped only once every share came back.)
pub(crate) enum Kept {
    Own(Buffer),
    Shared(Arc<Mutex<Buffer>>),
}

impl Kept {
    /// The buffer's address and length.
    pub(crate) fn range(&mut self) -> (*mut u8, usize) {
        match self {
            Kept::Own(b) => (b.stable_mut_ptr(), b.bytes_len()),
            Kept::Shared(s) => {
                let mut b = s.lock();
                (b.stable_mut_ptr(), b.bytes_len())
            }
        }
    }

    /// The buffer if this is all of it (a share of memory lent over rails is not).
    pub(crate) fn into_own(self) -> Option<Buffer> {
        match self {
            Kept::Own(b) => Some(b),
            Kept::Shared(_) => None,
        }
    }
}

/// The owner side's state for one connection.
#[derive(Default)]
pub(crate) struct Lending {
    /// The heap requests are served from, and the limits; `None`: requests are refused.
    serving: Option<(Heap, RemoteLimits)>,
    lent: HashMap<u64, Lent>,
    bytes: u64,
    /// Buffers the peer handed over that the application has not taken yet (counted against
    /// the limits, so a peer cannot grow them without bound).
    handed: (usize, u64),
    /// Grants and pushes told to the peer so far.
    announced: u64,
}

/// Entries' handles come from one counter for the whole process: a handle meant for one
/// connection's registry names nothing in another's.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

impl Lending {
    /// Registers `lent` under a fresh handle.
    pub(crate) fn insert(&mut self, lent: Lent) -> u64 {
        let handle = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        self.bytes += lent.keyed.remote().len;
        self.lent.insert(handle, lent);
        handle
    }

    /// The heap requests are served from, and the limits (`None`: requests are refused).
    pub(crate) fn serving(&self) -> Option<(Heap, RemoteLimits)> {
        self.serving.clone()
    }

    /// Serves requests from `serving` from now on (`None`: refuses them).
    pub(crate) fn set_serving(&mut self, serving: Option<(Heap, RemoteLimits)>) {
        self.serving = serving;
    }

    /// Counts a buffer of `bytes` the peer handed over (`true`) or the application took
    /// (`false`).
    pub(crate) fn handed(&mut self, bytes: u64, arrived: bool) {
        if arrived {
            self.handed.0 += 1;
            self.handed.1 += bytes;
        } else {
            self.handed.0 -= 1;
            self.handed.1 -= bytes;
        }
    }

    /// Marks `handle` as told to the peer.
    pub(crate) fn announce(&mut self, handle: u64) {
        if let Some(l) = self.lent.get_mut(&handle).filter(|l| !l.announced) {
            l.announced = true;
            self.announced += 1;
        }
    }

    /// Entries lent now, their bytes, and how many were told to the peer so far.
    pub(crate) fn counts(&self) -> (usize, u64, u64) {
        (self.lent.len(), self.bytes, self.announced)
    }

    /// Whether lending `len` more bytes stays within `limits`; `Err` carries the bytes left.
    pub(crate) fn room(&self, len: u64, limits: &RemoteLimits) -> std::result::Result<(), u64> {
        let bytes = self.bytes.saturating_add(self.handed.1);
        let left = limits.max_bytes.saturating_sub(bytes);
        if self.lent.len() + self.handed.0 >= limits.max_buffers || len > left {
            return Err(left);
        }
        Ok(())
    }

    /// Takes the entry `handle` out of the registry (`None`: unknown or already released).
    pub(crate) fn remove(&mut self, handle: u64) -> Option<Lent> {
        let lent = self.lent.remove(&handle)?;
        self.bytes -= lent.keyed.remote().len;
        Some(lent)
    }

    /// Everything lent, taken out of the registry.
    pub(crate) fn take_all(&mut self) -> HashMap<u64, Lent> {
        self.bytes = 0;
        std::mem::take(&mut self.lent)
    }
}

/// Makes a key for exactly the buffer `kept` keeps with `access` (see `transfer::exact`: a
/// window bound through this connection) and registers the entry. The entry is in the registry
/// before the bind is posted, so a cancelled bind leaves it there (released with the
/// connection). On failure `kept` comes back unless the bind's flush was lost. The entry is
/// not announced: the peer cannot release it until [`Lending::announce`].
pub(crate) async fn lend(
    lending: &Mutex<Lending>,
    sh: &Arc<Shared>,
    kept: Kept,
    access: Access,
) -> std::result::Result<(u64, RemoteBuf), Rejected<Kept>> {
    probe_windows(sh).await;
    let (bind, handle, remote) = start_lend(lending, sh, kept, access)?;
    match bind.await {
        Ok(_) => Ok((handle, remote)),
        // Refused, or failed and flushed: the window is not bound, the memory is ours again
        // (unless the connection's failure path already took it).
        Err(Rejected { error, buf: Some(_) }) => {
            let lent = lending.lock().remove(handle);
            Err(Rejected { error, buf: lent.and_then(|l| l.keyed.into_buf().ok()) })
        }
        // The flush never came: the entry stays (parked with the connection, never freed early).
        Err(Rejected { error, buf: None }) => Err(Rejected { error, buf: None }),
    }
}

/// Probes `sh`'s device for how it confines memory windows, if no grant did yet (milliseconds
/// of verbs calls, on the blocking pool; see `transfer::exact`).
pub(crate) async fn probe_windows(sh: &Arc<Shared>) {
    let ctx = sh.conn().pd().context();
    if ctx.confinement_settled().is_none() {
        let (ctx, qp) = (ctx.clone(), sh.conn().qp());
        let at = Some((qp.port(), qp.gid_index()));
        let _ = tokio::task::spawn_blocking(move || ctx.confines_windows_on(at)).await;
    }
}

/// Makes the key, registers the entry, and posts the window's bind (no await: the verbs
/// handles stay out of the future's state). Returns the bind in flight, the entry's handle and
/// what the peer needs.
fn start_lend(
    lending: &Mutex<Lending>,
    sh: &Arc<Shared>,
    mut kept: Kept,
    access: Access,
) -> std::result::Result<(Op<NoBytes>, u64, RemoteBuf), Rejected<Kept>> {
    let (ptr, len) = kept.range();
    // SAFETY: `kept` owns `[ptr, ptr + len)` (the buffer, or a share of it that keeps it
    // allocated) and moves into the Keyed with its key, which drops it only once the key is dead
    // and released, or never; nothing references the bytes meanwhile (a Keyed gives no access
    // to them, and a share's buffer is unwrapped only once every share came back).
    let (keyed, bind) = unsafe { Keyed::prepare_over(sh.conn(), ptr, len, kept, access)? };
    let remote = keyed.remote();
    let handle = lending.lock().insert(Lent { keyed, announced: false });
    let op = Op::control(sh.clone(), bind);
    Ok((op, handle, remote))
}

/// Kills the key of `handle` (the window's invalidation) and takes what it keeps out of the
/// registry. `None` if the handle is unknown, not announced yet while `announced` is asked
/// (its bind is in flight: a peer that names it breaks nothing), or the key could not be
/// killed (a failed invalidation fails the connection, whose failure path frees the entry
/// once the queue pair is flushed), or an exact registration the device refused to remove (the
/// buffer is leaked).
pub(crate) async fn unlend(lending: &Mutex<Lending>, sh: &Arc<Shared>, handle: u64, announced: bool) -> Option<Kept> {
    let revocation =
        lending.lock().lent.get(&handle).filter(|l| l.announced || !announced).map(|l| l.keyed.revocation())?;
    Op::control(sh.clone(), revocation).await.ok()?;
    let lent = lending.lock().remove(handle)?;
    lent.keyed.into_buf().ok()
}

/// Checks that `heap` can lend through connections in `pd`: built with memory-window binding,
/// bound to `pd`.
pub(crate) fn check_lending_heap(heap: &Heap, pd: &Pd) -> Result<()> {
    if !heap.access().contains(Access::MW_BIND) {
        return Err(Error::InvalidArgument("lending remote memory needs a heap built with Access::MW_BIND".into()));
    }
    if heap.alloc(1)?.keys_for(pd).is_none() {
        return Err(Error::InvalidArgument("the heap is not bound to the connection's PD".into()));
    }
    Ok(())
}

/// The wire's access bits for `access` (remote read and/or write; `None` for anything else).
pub(crate) fn access_bits(access: Access) -> Option<u8> {
    if !grant_rights(access) {
        return None;
    }
    let mut b = 0;
    if access.contains(Access::REMOTE_READ) {
        b |= READ;
    }
    if access.contains(Access::REMOTE_WRITE) {
        b |= WRITE;
    }
    Some(b)
}

/// The rights of the wire's access bits.
pub(crate) fn access_of(bits: u8) -> Access {
    let mut a = Access::NONE;
    if bits & READ != 0 {
        a |= Access::REMOTE_READ;
    }
    if bits & WRITE != 0 {
        a |= Access::REMOTE_WRITE;
    }
    a
}

/// Counts of live [`RemoteMemory`] handles.
#[derive(Default)]
pub(crate) struct Held {
    buffers: AtomicU64,
    bytes: AtomicU64,
}

impl Held {
    /// Counts a handle of `bytes`.
    pub(crate) fn count(&self, bytes: u64) {
        self.buffers.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Stops counting a handle of `bytes`.
    pub(crate) fn uncount(&self, bytes: u64) {
        self.buffers.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Handles counted now, and their bytes.
    pub(crate) fn now(&self) -> (u64, u64) {
        (self.buffers.load(Ordering::Relaxed), self.bytes.load(Ordering::Relaxed))
    }
}

/// Memory of the peer's heap that this side may access, until the handle is dropped: requested
/// with [`crate::transfer::AsyncConnection::request_remote`] or pushed by the peer
/// ([`crate::transfer::AsyncConnection::pushed`]). Use [`RemoteMemory::remote`] with the
/// connection's one-sided operations.
///
/// Dropping the handle tells the peer, which revokes the rkey and frees the memory;
/// [`crate::transfer::AsyncConnection::hand_over`] gives it back with its contents instead.
/// The rkey works through this connection only (its queue pair), and only on exactly this
/// memory. If the connection fails or closes, the peer frees it on its own, once the rkey has
/// stopped working (the connection's queue pair in the error state and flushed).
pub struct RemoteMemory {
    remote: RemoteBuf,
    handle: u64,
    access: Access,
    link: Option<Link>,
}

/// What a live handle tells when it goes.
struct Link {
    out: UnboundedSender<Msg>,
    held: Arc<Held>,
}

impl std::fmt::Debug for RemoteMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteMemory")
            .field("remote", &self.remote)
            .field("handle", &self.handle)
            .field("access", &self.access)
            .finish()
    }
}

impl RemoteMemory {
    pub(crate) fn new(
        remote: RemoteBuf,
        handle: u64,
        access: Access,
        out: UnboundedSender<Msg>,
        held: Arc<Held>,
    ) -> RemoteMemory {
        held.count(remote.len);
        RemoteMemory { remote, handle, access, link: Some(Link { out, held }) }
    }

    /// Address, length and rkey, for [`crate::transfer::AsyncConnection::write`] and friends.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.remote.len
    }

    /// Never true: remote memory is at least one byte.
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }

    /// The rights granted (remote read and/or write).
    pub fn access(&self) -> Access {
        self.access
    }

    /// The peer's name for this memory (unique on the connection while the handle lives).
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Gives the handle up without telling the peer; returns the handle's name.
    pub(crate) fn detach(mut self) -> (u64, Option<UnboundedSender<Msg>>) {
        (self.handle, self.unlink())
    }

    /// Stops counting this handle as held; the sender to tell its connection, if still linked.
    fn unlink(&mut self) -> Option<UnboundedSender<Msg>> {
        let l = self.link.take()?;
        l.held.uncount(self.remote.len);
        Some(l.out)
    }
}

impl Drop for RemoteMemory {
    fn drop(&mut self) {
        if let Some(out) = self.unlink() {
            // The connection may be gone: then the peer released it when it noticed.
            let _ = out.send(Msg::Release { handle: self.handle });
        }
    }
}
