//! Protection domains.

use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::Context;

pub(crate) struct PdInner {
    pub(crate) pd: *mut ffi::ibv_pd,
    pub(crate) ctx: Context,
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
    /// [`Error::Verbs`] if `ibv_alloc_pd` fails.
    pub fn new(ctx: &Context) -> Result<Pd> {
        ctx.usable()?;
        // SAFETY: ctx is a live context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.as_raw()) };
        if pd.is_null() {
            return Err(Error::verbs("ibv_alloc_pd", 0));
        }
        Ok(Pd { inner: Arc::new(PdInner { pd, ctx: ctx.clone() }) })
    }

    /// The device this PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// A process-unique identity for this PD (stable while it lives).
    pub fn id(&self) -> usize {
        self.inner.pd as usize
    }

    /// The raw `ibv_pd`, valid while this `Pd` lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.pd
    }
}
