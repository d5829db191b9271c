//! Memory windows: remote access to a sub-range of a region, bound and revoked by work requests.

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::Pd;

/// A type 2 memory window (`ibv_alloc_mw`). Bound to a range with a `BIND_MW` work request, it
/// gets an rkey of its own that grants access to just that range through one QP; a
/// `LOCAL_INV` (or deallocation) revokes it. Keeps its PD alive.
pub struct Mw {
    mw: *mut ffi::ibv_mw,
    _pd: Pd,
}

// SAFETY: an ibv_mw is used only through verbs calls, which are thread-safe; freed in Drop.
unsafe impl Send for Mw {}
// SAFETY: &Mw only reads the rkey.
unsafe impl Sync for Mw {}

impl Mw {
    /// Allocates a type 2 window in `pd`.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if `ibv_alloc_mw` fails (`EOPNOTSUPP` when the provider has no windows).
    /// - [`Error::DeviceRemoved`] once the device was found removed
    ///   ([`Context::is_removed`](crate::verbs::Context::is_removed)).
    pub fn new(pd: &Pd) -> Result<Mw> {
        pd.context().usable_for_new()?;
        // SAFETY: pd is live; returns None (errno EOPNOTSUPP) when the provider lacks windows.
        match unsafe { ffi::ibv_alloc_mw(pd.as_raw(), ffi::ibv_mw_type::IBV_MW_TYPE_2) } {
            Some(mw) if !mw.is_null() => Ok(Mw { mw, _pd: pd.clone() }),
            _ => Err(Error::verbs("ibv_alloc_mw", 0)),
        }
    }

    /// The window's current rkey (before a bind: its initial key).
    pub fn rkey(&self) -> u32 {
        // SAFETY: mw is live.
        unsafe { (*self.mw).rkey }
    }

    /// The rkey to bind with next: same index, next 8-bit tag (as `ibv_inc_rkey`).
    pub fn next_rkey(&self) -> u32 {
        let r = self.rkey();
        (r & !0xff) | (r.wrapping_add(1) & 0xff)
    }

    /// The raw `ibv_mw`, valid while this `Mw` lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mw {
        self.mw
    }

    /// Deallocates the window now, reporting a refusal (dropping it only logs one).
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_dealloc_mw` fails: the window may still be bound, so whatever
    /// it lies over must be kept for good.
    pub fn deallocate(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped: its PD handle is moved out once, here.
        let pd = unsafe { std::ptr::read(&this._pd) };
        let rc = dealloc(this.mw, &pd);
        if rc != 0 {
            return Err(Error::verbs("ibv_dealloc_mw", rc));
        }
        Ok(())
    }
}

/// `ibv_dealloc_mw` of `mw` (of `pd`); 0, or the verbs error (nothing done in a fork()ed child,
/// where the window is the parent's).
fn dealloc(mw: *mut ffi::ibv_mw, pd: &Pd) -> i32 {
    if !pd.context().owned_here() {
        return 0; // the parent's (a fork()ed child's copy)
    }
    // SAFETY: allocated by ibv_alloc_mw, deallocated once (by `deallocate` or the drop).
    unsafe { ffi::ibv_dealloc_mw(mw) }
}

impl Drop for Mw {
    fn drop(&mut self) {
        let rc = dealloc(self.mw, &self._pd);
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_mw failed");
        }
    }
}
