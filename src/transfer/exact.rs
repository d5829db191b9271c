//! A remote key for exactly one owned buffer's bytes: what grants ([`crate::transfer::Grant`])
//! and lent remote memory hand a peer.
//!
//! Where the device confines a type 2 memory window to the window's own range (probed once per
//! device: [`crate::verbs::Context::confines_memory_windows`]), the key is a window bound over
//! the buffer through the connection: a work request, no registration, and the key works on
//! that connection only. Elsewhere (Soft-RoCE on Linux 6.1 checks a window only against the
//! region under it, a whole heap chunk) the key is a registration of exactly the buffer's bytes
//! (`ibv_reg_mr`: tens of microseconds, one more pin and one of the device's `max_mr` regions;
//! the key is valid on every connection of the PD, as [`crate::heap::Buffer::expose`]'s), and
//! revoking it is deregistering it: synchronous, no work request.

use crate::error::{Error, Result};
use crate::heap::{chunk_of, mr_and_access_of};
use crate::transfer::Connection;
use crate::verbs::{Access, Mr, Mw, SendOp};

/// The key exposing a buffer.
pub(crate) enum Key {
    /// A type 2 window bound (or to be bound) through the connection: dead once invalidated,
    /// never bound, or its queue pair is in the error state and flushed.
    Window(Mw),
    /// A registration of exactly the buffer: dead once deregistered.
    Region(Mr),
}

/// A buffer and the key that exposes it. Dropping it releases both: a window is deallocated
/// (only do that once it is dead, see [`Key::Window`]) and the buffer freed; a region is
/// deregistered first, and if the device refuses, the buffer is leaked, never freed.
pub(crate) struct Keyed<B> {
    /// `None` only while being taken apart.
    key: Option<Key>,
    buf: Option<B>,
}

/// A key for `[ptr, ptr + len)`: what [`exact_key`] returns.
pub(crate) struct Prepared {
    pub(crate) key: Key,
    /// The rkey to hand the peer.
    pub(crate) rkey: u32,
    /// For a window: the bind request to post on the connection (the key works once it has
    /// completed). `None` for a region: it works at once.
    pub(crate) bind: Option<SendOp>,
}

/// Whether `access` is what a grant gives: remote read and/or write, nothing else.
pub(crate) fn grant_rights(access: Access) -> bool {
    let read_write = Access::REMOTE_READ | Access::REMOTE_WRITE;
    access.bits() & !read_write.bits() == 0 && access.is_remote()
}

/// A key for exactly `[ptr, ptr + len)` of heap memory registered in `conn`'s PD by a heap
/// built with [`Access::MW_BIND`], with `access` (remote read and/or write): a window where the
/// device confines windows (the first call on a device probes that: milliseconds), else a
/// registration of just that range. Nothing is posted.
///
/// # Safety
/// `[ptr, ptr + len)` is a live allocation owned by the caller, which keeps it (never frees nor
/// reuses it) until the returned key is dead: a window invalidated or its queue pair destroyed,
/// a region deregistered with success (a [`Keyed`] holding both does that) — or forever. Until
/// then a peer may write it at any time: no reference to it may be used meanwhile.
///
/// # Errors
/// [`Error::InvalidArgument`] (an empty range, rights other than remote read/write, or a heap
/// without [`Access::MW_BIND`]); [`Error::NotRegistered`] (not memory of a heap bound to the
/// PD); [`Error::Verbs`] (allocating the window, or the registration, e.g. the memlock limit);
/// [`Error::Forked`] or [`Error::DeviceRemoved`].
pub(crate) unsafe fn exact_key(conn: &Connection, ptr: *mut u8, len: usize, access: Access) -> Result<Prepared> {
    if len == 0 {
        return Err(Error::InvalidArgument("a grant of zero bytes".into()));
    }
    if !grant_rights(access) {
        return Err(Error::InvalidArgument("a grant gives remote read and/or write rights only".into()));
    }
    let pd = conn.pd();
    let (mr, heap_access) = mr_and_access_of(ptr, pd).ok_or(Error::NotRegistered { addr: ptr as u64 })?;
    // One chunk holds the whole range (an allocation never spans two; checked all the same, as
    // a registration of the range would take whatever lies past the chunk).
    let last = ptr as usize + (len - 1);
    if chunk_of(ptr) != chunk_of(last as *const u8) {
        return Err(Error::NotRegistered { addr: last as u64 });
    }
    // Required on every device, so that code that works on one works on all.
    if !heap_access.contains(Access::MW_BIND) {
        return Err(Error::InvalidArgument("a grant needs a heap built with Access::MW_BIND".into()));
    }
    let qp = conn.qp();
    if pd.context().confines_windows_on(Some((qp.port(), qp.gid_index()))) {
        let mw = Mw::new(pd)?;
        let rkey = mw.next_rkey();
        let bind =
            SendOp::BindMw { mw: mw.as_raw(), rkey, mr, addr: ptr as u64, len: len as u64, access: access.bits() };
        return Ok(Prepared { key: Key::Window(mw), rkey, bind: Some(bind) });
    }
    // Remote write needs local write on the region (a verbs rule); nothing local uses its lkey.
    let rights = if access.contains(Access::REMOTE_WRITE) { access | Access::LOCAL_WRITE } else { access };
    // SAFETY: the range stays owned and mapped until the region is deregistered with success
    // (function contract); the peer's access to it is what the caller grants.
    let mr = unsafe { Mr::register(pd, ptr, len, rights)? };
    Ok(Prepared { rkey: mr.rkey(), key: Key::Region(mr), bind: None })
}

impl<B> Keyed<B> {
    /// `buf`, exposed by `key` (made for it by [`exact_key`]).
    pub(crate) fn new(key: Key, buf: B) -> Keyed<B> {
        Keyed { key: Some(key), buf: Some(buf) }
    }

    /// The buffer.
    #[cfg(feature = "tokio")]
    pub(crate) fn buf(&self) -> &B {
        self.buf.as_ref().expect("a Keyed holds its buffer")
    }

    /// Whether the key is a window (revoked by invalidating it through the connection).
    pub(crate) fn is_window(&self) -> bool {
        matches!(self.key, Some(Key::Window(_)))
    }

    /// Revokes the key and gives the buffer back: a window must be dead already (see
    /// [`Key::Window`]); a region is deregistered now.
    ///
    /// # Errors
    /// [`Error::Verbs`] if the device refused to deregister the region (the peer may still
    /// reach the buffer: it is leaked); [`Error::Forked`] in a fork()ed child (the region is the
    /// parent's; the child's copy of the buffer is leaked too).
    pub(crate) fn into_buf(mut self) -> Result<B> {
        let buf = self.buf.take().expect("a Keyed holds its buffer");
        match self.key.take().expect("a Keyed holds its key") {
            Key::Window(mw) => drop(mw),
            Key::Region(mr) if !mr.pd().context().owned_here() => {
                // A fork()ed child's copy: the registration is the parent's.
                drop(mr);
                std::mem::forget(buf);
                return Err(Error::Forked("this grant"));
            }
            Key::Region(mr) => {
                if let Err(e) = mr.deregister() {
                    tracing::error!("revoking a grant's registration: {e}; its buffer is leaked");
                    crate::verbs::LEAKED_MAPPINGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    std::mem::forget(buf);
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
        let _ = Keyed { key: Some(key), buf: Some(buf) }.into_buf();
    }
}
