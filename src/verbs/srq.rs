//! A shared receive queue (`ibv_srq`): one pool of receive requests for many queue pairs.

use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::verbs::wr::post_one_recv;
use crate::verbs::{Pd, Sge};

pub(crate) struct SrqInner {
    srq: *mut ffi::ibv_srq,
    pd: Pd,
    max_wr: u32,
    max_sge: u32,
    born: Born,
}

// SAFETY: an ibv_srq may be posted to from any thread (providers lock internally); it is
// destroyed only in Drop, when no clone (and so no QP using it) is left.
unsafe impl Send for SrqInner {}
// SAFETY: see Send.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        if !self.born.here() {
            return; // the parent's (a fork()ed child's copy)
        }
        // SAFETY: created by ibv_create_srq and destroyed once; every QP using it held a clone,
        // so none is left.
        let rc = unsafe { ffi::ibv_destroy_srq(self.srq) };
        if rc != 0 {
            tracing::error!(rc, "ibv_destroy_srq failed");
        }
    }
}

/// A shared receive queue: queue pairs built with it ([`crate::verbs::QpBuilder::srq`]) take
/// their receive requests from it instead of a receive queue of their own, so the receive
/// memory of a server is sized by its traffic, not by its number of peers. Cheap to clone;
/// destroyed when the last clone and the last QP using it are gone.
#[derive(Clone)]
pub struct Srq {
    inner: Arc<SrqInner>,
}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Srq").field("max_wr", &self.inner.max_wr).field("max_sge", &self.inner.max_sge).finish()
    }
}

impl Srq {
    /// Creates a shared receive queue in `pd` holding up to `max_wr` receive requests of up to
    /// `max_sge` SGEs each (the device may grant more: see [`Srq::max_wr`]).
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `max_wr` or `max_sge` is 0.
    /// - [`Error::Verbs`] if `ibv_create_srq` fails (e.g. above the device's `max_srq_wr`).
    /// - [`Error::Forked`] in a fork()ed child of the process that opened `pd`'s device.
    /// - [`Error::DeviceRemoved`] once the device was found removed
    ///   ([`Context::is_removed`](crate::verbs::Context::is_removed)).
    pub fn new(pd: &Pd, max_wr: u32, max_sge: u32) -> Result<Srq> {
        pd.context().usable_for_new()?;
        if max_wr == 0 || max_sge == 0 {
            return Err(Error::InvalidArgument("a shared receive queue needs max_wr and max_sge of at least 1".into()));
        }
        // SAFETY: ibv_srq_init_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = max_wr;
        attr.attr.max_sge = max_sge;
        // SAFETY: pd is live; attr is fully initialised (the device writes back what it granted).
        let srq = unsafe { ffi::ibv_create_srq(pd.as_raw(), &mut attr) };
        if srq.is_null() {
            return Err(Error::verbs("ibv_create_srq", 0));
        }
        let born = pd.context().inner.born;
        Ok(Srq {
            inner: Arc::new(SrqInner {
                srq,
                pd: pd.clone(),
                max_wr: attr.attr.max_wr,
                max_sge: attr.attr.max_sge,
                born,
            }),
        })
    }

    /// How many receive requests it holds (what the device granted, at least what was asked).
    pub fn max_wr(&self) -> u32 {
        self.inner.max_wr
    }

    /// SGEs per receive request.
    pub fn max_sge(&self) -> u32 {
        self.inner.max_sge
    }

    /// The PD it was created in (QPs using it must be in the same PD).
    pub fn pd(&self) -> &Pd {
        &self.inner.pd
    }

    /// The raw `ibv_srq`, valid while this value lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.srq
    }

    /// Destroys the queue now, if this is its last handle: memory its receives name may be
    /// released only after this succeeded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if another handle (or a QP using the queue) is left;
    /// [`Error::Verbs`] if `ibv_destroy_srq` fails (the queue is leaked then); [`Error::Forked`]
    /// in a fork()ed child (the queue is the parent's, and stays).
    pub(crate) fn destroy(self) -> Result<()> {
        let inner = Arc::try_unwrap(self.inner)
            .map_err(|_| Error::InvalidArgument("the shared receive queue is still in use".into()))?;
        let inner = std::mem::ManuallyDrop::new(inner);
        // SAFETY: the PD clone is taken out once; `inner` is never dropped.
        let pd = unsafe { std::ptr::read(&inner.pd) };
        inner.born.check("this shared receive queue")?;
        // SAFETY: the last handle of a live queue, destroyed once (its Drop never runs).
        let rc = unsafe { ffi::ibv_destroy_srq(inner.srq) };
        drop(pd);
        if rc != 0 {
            return Err(Error::verbs("ibv_destroy_srq", rc));
        }
        Ok(())
    }

    /// Posts one receive request scattering into `sges`; whichever QP using the queue receives
    /// next consumes it (its completion names that QP: [`crate::verbs::WorkCompletion::qp_num`]).
    ///
    /// # Safety
    /// As [`crate::verbs::Qp::post_recv`]: the SGEs lie in live memory regions of the queue's PD
    /// registered with local write access, and the memory stays valid and untouched by the CPU
    /// until the receive's completion has been polled or the queue is destroyed.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `sges` has more entries than [`Srq::max_sge`] (nothing
    ///   is posted).
    /// - [`Error::Verbs`] if `ibv_post_srq_recv` fails (e.g. `ENOMEM`: the queue is full).
    /// - [`Error::Forked`] in a fork()ed child of the process that made the queue.
    pub unsafe fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        self.inner.born.check("this shared receive queue")?;
        let srq = self.inner.srq;
        // SAFETY: the queue is live (also for the verb in the closure, given a valid request);
        // memory per the contract.
        unsafe {
            post_one_recv(
                wr_id,
                sges,
                self.inner.max_sge,
                "the shared receive queue",
                "ibv_post_srq_recv",
                |wr, bad| ffi::ibv_post_srq_recv(srq, wr, bad),
            )
        }
    }
}
