//! Protection domains.

use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::Context;

pub(crate) struct PdInner {
    pub(crate) pd: *mut ffi::ibv_pd,
    pub(crate) ctx: Context,
    /// Registrations a heap withdrew when the device was removed (`ibv_mr` addresses), kept
    /// until the PD goes: a queue pair of this PD may still name one (a memory-window bind
    /// reads the `ibv_mr` when it is posted), and every queue pair holds the PD.
    retired: parking_lot::Mutex<Vec<usize>>,
}

// SAFETY: an ibv_pd may be used from any thread; it is freed only in Drop, when no MR, QP or
// other clone refers to it.
unsafe impl Send for PdInner {}
// SAFETY: see Send; verbs taking a PD are thread-safe.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        if !self.ctx.owned_here() {
            return; // the parent's (a fork()ed child's copy)
        }
        for &mr in self.retired.get_mut().iter() {
            // SAFETY: a registration in this PD, handed over by its heap, deregistered once;
            // nothing names it any more (every queue pair of this PD is gone).
            let rc = unsafe { ffi::ibv_dereg_mr(mr as *mut ffi::ibv_mr) };
            if rc != 0 {
                // Its chunk was marked leaked when withdrawn: never unmapped.
                tracing::warn!(device = %self.ctx.name(), rc, "ibv_dereg_mr of a withdrawn heap registration failed");
            }
        }
        // SAFETY: pd came from ibv_alloc_pd; every MR and QP holds an Arc to this value, so none
        // is alive any more. The context outlives this call (we hold a clone).
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::warn!(device = %self.ctx.name(), rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A protection domain: memory regions and queue pairs in the same PD can work together.
///
/// Cheap to clone. Memory regions and queue pairs keep their PD alive, so no drop order can free
/// a PD under a live MR or QP.
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pd").field("device", &self.inner.ctx.name()).field("id", &self.id()).finish()
    }
}

impl PartialEq for Pd {
    fn eq(&self, other: &Pd) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
impl Eq for Pd {}

impl Pd {
    /// Allocates a protection domain on `ctx`.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if `ibv_alloc_pd` fails.
    /// - [`Error::DeviceRemoved`] once the device was found removed
    ///   ([`Context::is_removed`](crate::verbs::Context::is_removed)).
    pub fn new(ctx: &Context) -> Result<Pd> {
        ctx.usable_for_new()?;
        // SAFETY: ctx is a live context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.as_raw()) };
        if pd.is_null() {
            return Err(Error::verbs("ibv_alloc_pd", 0));
        }
        Ok(Pd { inner: Arc::new(PdInner { pd, ctx: ctx.clone(), retired: parking_lot::Mutex::new(Vec::new()) }) })
    }

    /// The device this PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// A process-unique identity for this PD (stable while it lives).
    pub fn id(&self) -> usize {
        self.inner.pd as usize
    }

    /// Keeps registrations of this PD a heap withdrew (see `PdInner::retired`) until the PD is
    /// dropped, then deregisters them.
    ///
    /// # Safety
    /// Each `mrs` entry is a live registration in this PD that nothing else deregisters.
    pub(crate) unsafe fn retire(&self, mrs: impl IntoIterator<Item = *mut ffi::ibv_mr>) {
        self.inner.retired.lock().extend(mrs.into_iter().map(|m| m as usize));
    }

    /// The raw `ibv_pd`, valid while this `Pd` lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.pd
    }
}
