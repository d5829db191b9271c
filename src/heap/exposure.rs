//! Per-buffer remote keys: a memory region that covers exactly one [`crate::heap::Buffer`].
//!
//! A heap's chunks are registered for local access only (unless the heap was built with
//! [`crate::heap::HeapBuilder::remote_access_to_whole_chunks`]). When a buffer is exposed, it
//! gets a registration of its own over exactly its bytes (read-only for [`Buffer::remote`], the
//! heap's remote rights for [`Buffer::expose`]): the device checks every remote access against
//! that range, so a peer reaches this buffer and nothing next to it. The registration is
//! removed (`ibv_dereg_mr`: when it returns, the device no longer touches the range) before the
//! buffer's memory goes back to the heap; if the device refuses, the memory is never reused.
//! (One caveat outside our control: rxe in Linux 6.1 waits a bounded time for a responder still
//! holding the region in a multi-packet request, then deregisters anyway.)
//!
//! [`Buffer::remote`]: crate::heap::Buffer::remote
//! [`Buffer::expose`]: crate::heap::Buffer::expose
//!
//! Why a region and not a type 2 memory window: a window is bound through a queue pair and its
//! invalidation is a work request whose completion must be waited for, so it cannot be undone
//! from `Drop` without a connection; and Soft-RoCE (rxe, Linux 6.1) checks accesses through a
//! window against the range of the region under it, not the window's own, so a window over a
//! chunk-wide region does not confine a peer there. Windows bound per connection are
//! [`crate::transfer::Connection::grant`] (which on such devices binds its window over a
//! registration of exactly the buffer, like this one but without remote rights).

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::verbs::{Access, Mr, Pd};

/// The registrations that expose one buffer: at most one per PD.
#[derive(Default)]
pub(crate) struct Exposure {
    mrs: Mutex<Vec<Mr>>,
    /// A registration the device refused to remove: the buffer's memory must never be reused.
    stuck: AtomicBool,
}

impl Exposure {
    /// The rkey of the registration of `[addr, addr+len)` with `pd`, registering it on first use.
    ///
    /// # Safety
    /// `[addr, addr+len)` is a live heap allocation that is not freed (nor its chunk unmapped)
    /// before every registration of this record has been removed by [`Exposure::revoke`] with
    /// success — or ever, if it fails.
    unsafe fn rkey(&self, pd: &Pd, addr: *mut u8, len: usize, remote: Access) -> Result<u32> {
        let access = remote.remote_only().union(Access::LOCAL_WRITE);
        let mut mrs = self.mrs.lock();
        if let Some(mr) = mrs.iter().find(|m| m.pd() == pd && m.access() == access) {
            return Ok(mr.rkey());
        }
        // SAFETY: the range stays mapped and owned by the buffer until `revoke` succeeded
        // (function contract); the caller decides which remote rights are sound to give
        // (read-only for a buffer Rust code still references, more only for an `Exposed`).
        let mr = unsafe { Mr::register(pd, addr, len, access)? };
        let rkey = mr.rkey();
        mrs.push(mr);
        Ok(rkey)
    }

    /// Removes every registration. An error if the device refused one (now or earlier): the
    /// memory may still be reached and must be leaked.
    fn revoke(&self) -> Result<()> {
        let mrs = std::mem::take(&mut *self.mrs.lock());
        let mut first = None;
        for mr in mrs {
            if let Err(e) = mr.deregister() {
                self.stuck.store(true, Ordering::Relaxed);
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None if self.stuck.load(Ordering::Relaxed) => Err(Error::RevocationFailed),
            None => Ok(()),
        }
    }
}

/// The exposure slot a buffer carries: null until the buffer is first exposed.
#[derive(Default)]
pub(crate) struct Slot(AtomicPtr<Exposure>);

impl Slot {
    /// The rkey exposing `[addr, addr+len)` through `pd`.
    ///
    /// # Safety
    /// As [`Exposure::rkey`]; the owner calls [`Slot::revoke`] before freeing the memory.
    pub(crate) unsafe fn rkey(&self, pd: &Pd, addr: *mut u8, len: usize, remote: Access) -> Result<u32> {
        if !remote.is_remote() {
            return Err(Error::NoRemoteAccess);
        }
        let mut p = self.0.load(Ordering::Acquire);
        if p.is_null() {
            let fresh = Box::into_raw(Box::<Exposure>::default());
            match self.0.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => p = fresh,
                Err(current) => {
                    // SAFETY: `fresh` was never published; it is ours to free.
                    drop(unsafe { Box::from_raw(fresh) });
                    p = current;
                }
            }
        }
        // SAFETY: a published record lives until `revoke` (which takes `&mut self`, so no
        // shared borrow like this one is live then) frees it.
        unsafe { (*p).rkey(pd, addr, len, remote) }
    }

    /// Removes every registration. `Ok` when the memory is no longer reachable by any peer
    /// (also when it was never exposed); an error if the device refused to let go of a
    /// registration — then the memory must never be freed.
    pub(crate) fn revoke(&mut self) -> Result<()> {
        let p = *self.0.get_mut();
        if p.is_null() {
            return Ok(());
        }
        // SAFETY: published records are only freed here, under `&mut self`.
        let r = unsafe { (*p).revoke() };
        if r.is_ok() {
            *self.0.get_mut() = std::ptr::null_mut();
            // SAFETY: unpublished just now; nothing else refers to it.
            drop(unsafe { Box::from_raw(p) });
        }
        // On an error the record stays (and `stuck` with it): the owner leaks the memory.
        r
    }

    /// Whether any peer may still reach the buffer through a key of its own: a live
    /// registration, or one the device refused to remove.
    pub(crate) fn is_exposed(&self) -> bool {
        let p = self.0.load(Ordering::Acquire);
        if p.is_null() {
            return false;
        }
        // SAFETY: as in `rkey`.
        let e = unsafe { &*p };
        e.stuck.load(Ordering::Relaxed) || !e.mrs.lock().is_empty()
    }
}
