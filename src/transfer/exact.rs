//! A remote key for exactly one owned buffer's bytes, working through one connection only: what
//! grants ([`crate::transfer::Grant`]) and lent remote memory hand a peer.
//!
//! The key is always a type 2 memory window bound through the connection, so the device serves
//! it to that connection's queue pair only (never to another connection of the PD), and it dies
//! with an invalidation, or once the queue pair is in the error state and flushed. What the
//! window lies over depends on the device (probed once per device:
//! [`crate::verbs::Context::confines_memory_windows`]):
//! - where the device confines a window to the window's own range: the heap chunk's region (a
//!   work request, no registration);
//! - elsewhere (Soft-RoCE on Linux 6.1 checks a window only against the region under it): a
//!   registration of exactly the buffer's bytes with local rights only (`LOCAL_WRITE |
//!   MW_BIND`: its own key opens nothing to a peer), so the region's range is the buffer's. It
//!   costs an `ibv_reg_mr` (tens of microseconds, one more pin and one of the device's `max_mr`
//!   regions) and is deregistered after the window is deallocated.
//!
//! Either way the window carries the grant's remote rights. The connection keeps the window
//! ([`Windows`]): one nobody releases (a forgotten grant's) is deallocated when the connection is
//! dropped, once its queue pair is flushed, so the queue pair is never destroyed with a window
//! bound to it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::heap::{chunk_of, mr_and_access_of};
use crate::remote::RemoteBuf;
use crate::transfer::request::iobuf::IoBufMut;
use crate::transfer::request::iobuf::Rejected;
use crate::transfer::Connection;
use crate::verbs::{Access, Mr, Mw, SendOp};

/// The windows bound (or being bound) through one connection and not released yet. A key's
/// release takes its window out and deallocates it; the connection's drop deallocates those
/// left (keys forgotten, or released after it), once its queue pair is flushed.
pub(crate) struct Windows {
    live: Mutex<HashMap<u64, Mw>>,
    next: AtomicU64,
    /// A fork()ed child never takes the lock (a parent thread may have held it at the fork).
    born: Born,
}

impl Windows {
    /// An empty registry, for a connection made now.
    pub(crate) fn new() -> Windows {
        Windows { live: Mutex::new(HashMap::new()), next: AtomicU64::new(0), born: Born::now() }
    }

    fn insert(&self, mw: Mw) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.live.lock().insert(id, mw);
        id
    }

    /// Takes window `id` out (`None`: the connection deallocated it already, or a fork()ed
    /// child asks).
    fn take(&self, id: u64) -> Option<Mw> {
        if !self.born.here() {
            return None;
        }
        self.live.lock().remove(&id)
    }

    /// Deallocates every window left. Only once no queue pair they were bound through serves
    /// remote accesses any more (its connection's QP in the error state and flushed).
    pub(crate) fn deallocate_all(&self) {
        if !self.born.here() {
            return;
        }
        let left = std::mem::take(&mut *self.live.lock());
        if !left.is_empty() {
            tracing::debug!("deallocating {} memory windows nobody released (forgotten grants)", left.len());
        }
    }
}

/// The key exposing a buffer: a type 2 window bound (or to be bound) through the connection
/// (kept by its [`Windows`]), and the exact region under it where the device does not confine
/// windows. Dead once the window is invalidated or was never bound, or its queue pair is in
/// the error state and flushed (or destroyed).
pub(crate) struct Key {
    windows: Arc<Windows>,
    window: u64,
    /// A registration of exactly the buffer, local rights only (`None`: the window lies over
    /// the heap chunk's region).
    exact: Option<Mr>,
}

/// A buffer and the key that exposes it. Dropping it (only once the key is dead, see [`Key`])
/// releases both: the window is deallocated, then an exact region deregistered — if the
/// device refuses, the buffer is leaked, never freed — and the buffer freed.
pub(crate) struct Keyed<B> {
    /// `None` only while being taken apart.
    key: Option<Key>,
    buf: Option<B>,
    remote: RemoteBuf,
}

/// Whether `access` is what a grant gives: remote read and/or write, nothing else.
pub(crate) fn grant_rights(access: Access) -> bool {
    let read_write = Access::REMOTE_READ | Access::REMOTE_WRITE;
    access.bits() & !read_write.bits() == 0 && access.is_remote()
}

/// A key for exactly `[ptr, ptr + len)` of heap memory registered in `conn`'s PD by a heap
/// built with [`Access::MW_BIND`], with `access` (remote read and/or write), and the request
/// that binds it (to post on `conn`; the key works once it has completed). The first call on a
/// device probes it (milliseconds).
///
/// # Safety
/// `[ptr, ptr + len)` is a live allocation owned by the caller, which keeps it (never frees nor
/// reuses it) until the key is dead (see [`Key`]) and released — a [`Keyed`] holding both does
/// that — or forever. Until then a peer may write it at any time: no reference to it may be
/// used meanwhile.
///
/// # Errors
/// [`Error::InvalidArgument`] (an empty range, rights other than remote read/write, or a heap
/// without [`Access::MW_BIND`]); [`Error::NotRegistered`] (not memory of a heap bound to the
/// PD); [`Error::Verbs`] (allocating the window, or the exact registration, e.g. the memlock
/// limit); [`Error::Forked`] or [`Error::DeviceRemoved`].
unsafe fn exact_key(conn: &Connection, ptr: *mut u8, len: usize, access: Access) -> Result<(Key, u32, SendOp)> {
    if len == 0 {
        return Err(Error::InvalidArgument("a grant of zero bytes".into()));
    }
    if !grant_rights(access) {
        return Err(Error::InvalidArgument("a grant gives remote read and/or write rights only".into()));
    }
    let pd = conn.pd();
    let (chunk_mr, heap_access) = mr_and_access_of(ptr, pd)?;
    // One chunk holds the whole range (an allocation never spans two; checked all the same, as
    // a window or registration of the range would reach whatever lies past the chunk).
    let last = ptr as usize + (len - 1);
    if chunk_of(ptr) != chunk_of(last as *const u8) {
        return Err(Error::NotRegistered { addr: last as u64 });
    }
    // Required on every device, so that code that works on one works on all.
    if !heap_access.contains(Access::MW_BIND) {
        return Err(Error::InvalidArgument("a grant needs a heap built with Access::MW_BIND".into()));
    }
    let qp = conn.qp();
    let confined = pd.context().confines_windows_on(Some((qp.port(), qp.gid_index())));
    let mw = Mw::new(pd)?;
    let exact = if confined {
        None
    } else {
        // Local write (a window with remote write needs it on the region) and window binding:
        // no remote rights, so the region's own rkey opens nothing; the window carries them.
        // SAFETY: the range stays owned and mapped until the region is deregistered with
        // success (function contract); nothing local uses its lkey.
        Some(unsafe { Mr::register(pd, ptr, len, Access::LOCAL_WRITE | Access::MW_BIND)? })
    };
    let mr = exact.as_ref().map_or(chunk_mr, Mr::as_raw);
    let rkey = mw.next_rkey();
    let bind = SendOp::BindMw { mw: mw.as_raw(), rkey, mr, addr: ptr as u64, len: len as u64, access: access.bits() };
    // The connection keeps the window (the bind names it) until the key is released, or until
    // the connection goes.
    let windows = conn.windows().clone();
    let window = windows.insert(mw);
    Ok((Key { windows, window, exact }, rkey, bind))
}

impl<B: IoBufMut> Keyed<B> {
    /// Makes a key for exactly `buf` with `access` (remote read and/or write) on `conn`: the
    /// keyed buffer and the bind request to post on `conn` (the key works once it has
    /// completed; until then, and if it fails, the window is unbound and the keyed buffer can
    /// be taken apart at once). The heap must be built with [`Access::MW_BIND`]. The first
    /// call on a device probes it (milliseconds, see `Context::confines_memory_windows`).
    ///
    /// # Errors
    /// With the buffer back: the connection's failure, and as [`exact_key`].
    pub(crate) fn prepare(
        conn: &Connection,
        mut buf: B,
        access: Access,
    ) -> std::result::Result<(Keyed<B>, SendOp), Rejected<B>> {
        let (ptr, len) = (buf.stable_mut_ptr(), buf.bytes_len());
        // SAFETY: `buf` owns `[ptr, ptr + len)` and moves into the Keyed with its key, which
        // frees it only once the key is dead and released, or never; nothing references its
        // bytes meanwhile (a Keyed gives no access to them).
        unsafe { Keyed::prepare_over(conn, ptr, len, buf, access) }
    }
}

impl<K> Keyed<K> {
    /// [`Keyed::prepare`] for `[ptr, ptr + len)`, kept alive by `keep` (several keys over one
    /// buffer: each holds a share of it).
    ///
    /// # Safety
    /// As [`exact_key`], with `keep` as what keeps the range: until `keep` is dropped, the
    /// range stays allocated, and nothing references its bytes while any key over it lives.
    ///
    /// # Errors
    /// With `keep` back: the connection's failure, and as [`exact_key`].
    pub(crate) unsafe fn prepare_over(
        conn: &Connection,
        ptr: *mut u8,
        len: usize,
        keep: K,
        access: Access,
    ) -> std::result::Result<(Keyed<K>, SendOp), Rejected<K>> {
        // SAFETY: the caller's contract; the Keyed holds `keep` until the key is released.
        match conn.check().and_then(|()| unsafe { exact_key(conn, ptr, len, access) }) {
            Ok((key, rkey, bind)) => {
                let remote = RemoteBuf { addr: ptr as u64, len: len as u64, rkey };
                Ok((Keyed { key: Some(key), buf: Some(keep), remote }, bind))
            }
            Err(error) => Err(Rejected { error, buf: Some(keep) }),
        }
    }
}

impl<B> Keyed<B> {
    /// What the peer needs: address, length and the rkey.
    pub(crate) fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Whether the window lies over the heap chunk's region (else over an exact registration).
    #[cfg(test)]
    pub(crate) fn over_chunk(&self) -> bool {
        self.key.as_ref().is_some_and(|k| k.exact.is_none())
    }

    /// The request that revokes the key, to post on the connection it was bound through: the
    /// window's invalidation. Once it has completed with success the key is dead and
    /// [`Keyed::into_buf`] may run; if it cannot be posted or fails, the connection must be
    /// failed and the keyed buffer kept until its queue pair is flushed (or destroyed).
    pub(crate) fn revocation(&self) -> SendOp {
        SendOp::LocalInvalidate(self.remote.rkey)
    }

    /// Releases the key and gives the buffer back. Only once the key is dead (see [`Key`]):
    /// deallocates the window, then deregisters an exact region.
    ///
    /// # Errors
    /// [`Error::Verbs`] if the device refused to deallocate the window or to deregister the
    /// exact region (the buffer is leaked); [`Error::Forked`] in a fork()ed child with an exact region (the region is the
    /// parent's; the child's copy of the buffer is leaked too).
    pub(crate) fn into_buf(mut self) -> Result<B> {
        let buf = self.buf.take().expect("a Keyed holds its buffer");
        let Key { windows, window, exact } = self.key.take().expect("a Keyed holds its key");
        // The window first: a region with a window bound cannot be deregistered (rxe refuses).
        // A window the device would not deallocate may still be bound: keep everything.
        if let Some(Err(e)) = windows.take(window).map(Mw::deallocate) {
            std::mem::forget(exact);
            let why = format_args!("deallocating a grant's memory window: {e}; its buffer is leaked");
            crate::verbs::keep_for_good(buf, why);
            return Err(e);
        }
        match exact {
            None => {}
            Some(mr) if !mr.pd().context().owned_here() => {
                // A fork()ed child's copy: the registration is the parent's.
                drop(mr);
                std::mem::forget(buf);
                return Err(Error::Forked("this grant"));
            }
            Some(mr) => {
                if let Err(e) = mr.deregister() {
                    let why = format_args!("releasing a grant's exact registration: {e}; its buffer is leaked");
                    crate::verbs::keep_for_good(buf, why);
                    return Err(e);
                }
            }
        }
        Ok(buf)
    }

    /// A fork()ed child's copy: the key is the parent's (dropping it in the child destroys
    /// nothing); the bytes are the child's own.
    pub(crate) fn into_forked_copy(mut self) -> B {
        drop(self.key.take());
        self.buf.take().expect("a Keyed holds its buffer")
    }
}

impl<B> Drop for Keyed<B> {
    fn drop(&mut self) {
        let (Some(key), Some(buf)) = (self.key.take(), self.buf.take()) else { return };
        // Dropped errors are logged by `into_buf`, which leaks the buffer then.
        let _ = Keyed { key: Some(key), buf: Some(buf), remote: self.remote }.into_buf();
    }
}
