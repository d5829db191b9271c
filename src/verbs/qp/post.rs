//! Posting to a queue pair: the checks a work request passes first, the send-queue chain (one
//! doorbell) with what a partially accepted chain leaves, and receives.

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::qp::Qp;
use crate::verbs::wr::post_one_recv;
use crate::verbs::{SendOp, SendWr, Sge};

impl Qp {
    fn validate(&self, wr: &SendWr<'_>) -> Result<()> {
        if wr.sges.len() > self.caps.max_send_sge as usize {
            return Err(Error::InvalidArgument(format!(
                "work request {} has {} SGEs; the QP allows {}",
                wr.wr_id,
                wr.sges.len(),
                self.caps.max_send_sge
            )));
        }
        if let SendOp::FetchAdd { remote, .. } | SendOp::CompareSwap { remote, .. } = wr.op {
            if remote.addr % 8 != 0 || wr.sges.len() != 1 || wr.sges[0].len() != 8 {
                return Err(Error::InvalidArgument(format!(
                    "atomic work request {} needs an 8-byte-aligned remote word (got {:#x}) and one 8-byte local SGE",
                    wr.wr_id, remote.addr
                )));
            }
        }
        Ok(())
    }

    /// Posts `wrs` to the send queue as one chain (one doorbell).
    ///
    /// # Safety
    /// Every SGE must lie in a live memory region of this QP's PD, and that memory must stay
    /// valid — and not be accessed by the CPU in a way that races the NIC (written while the
    /// NIC reads it, or read or written while it writes it) — until the completion of the
    /// request (or of a later signaled request on this QP) has been polled. Remote addresses are
    /// checked by the peer's NIC, not here.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if a request has more SGEs than the QP's `max_send_sge`, or
    ///   is an atomic without an 8-byte-aligned remote word and exactly one 8-byte SGE (checked
    ///   before anything is posted).
    /// - [`Error::Verbs`] if the device refused the first request (nothing was posted).
    /// - [`Error::PartialPost`] if it accepted some requests and refused the next (`bad_wr`): the
    ///   accepted ones are on the queue and use their memory until they complete — or, once the
    ///   QP is moved to the error state, until their flush completions have been polled. A
    ///   provider that fails a chain without setting `bad_wr` gives `posted == total`.
    pub unsafe fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.usable()?;
        for wr in wrs {
            self.validate(wr)?;
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        let (rc, posted) = match wrs {
            [] => return Ok(()),
            [one] => {
                let mut raw = one.raw();
                // SAFETY: raw is a valid single request; its SGE list outlives the call; the
                // memory contract is the caller's (function contract).
                (unsafe { ffi::ibv_post_send(self.qp, &mut raw, &mut bad) }, 0)
            }
            many => {
                let mut raws: Vec<ffi::ibv_send_wr> = many.iter().map(SendWr::raw).collect();
                let base = raws.as_mut_ptr();
                for i in 0..raws.len() - 1 {
                    // SAFETY: i+1 < len; pointers into the live Vec, which is not resized.
                    raws[i].next = unsafe { base.add(i + 1) };
                }
                // SAFETY: the chain lives in `raws` for the whole call; see above.
                let rc = unsafe { ffi::ibv_post_send(self.qp, base, &mut bad) };
                // bad_wr points at the first request not posted (an element of `raws`). A
                // provider that leaves it unset tells nothing: assume every request may be on the
                // queue (the caller then waits for their flush, or leaks their memory).
                let posted = if rc == 0 {
                    0
                } else if bad.is_null() {
                    raws.len()
                } else {
                    // SAFETY: both pointers are into the same live Vec.
                    usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(raws.len()).min(raws.len())
                };
                (rc, posted)
            }
        };
        match (rc, posted) {
            (0, _) => Ok(()),
            (rc, 0) => Err(Error::verbs("ibv_post_send", rc)),
            (rc, posted) => {
                let errno = if rc > 0 { rc } else { std::io::Error::last_os_error().raw_os_error().unwrap_or(0) };
                Err(Error::PartialPost {
                    verb: "ibv_post_send",
                    posted,
                    total: wrs.len(),
                    errno,
                    text: std::io::Error::from_raw_os_error(errno).to_string(),
                })
            }
        }
    }

    /// Posts one receive request scattering into `sges`.
    ///
    /// # Safety
    /// The SGEs must lie in live memory regions of this QP's PD registered with
    /// [`Access::LOCAL_WRITE`](crate::verbs::Access::LOCAL_WRITE), and the memory must stay valid and untouched by the CPU until
    /// the receive's completion has been polled (or the QP is destroyed).
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if the QP takes its receives from a shared receive queue,
    ///   or `sges` has more entries than the QP's `max_recv_sge` (nothing is posted).
    /// - [`Error::Verbs`] if `ibv_post_recv` fails (e.g. `ENOMEM`: the receive queue is full).
    pub unsafe fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        self.usable()?;
        if self.srq.is_some() {
            return Err(Error::InvalidArgument(
                "this QP takes its receives from a shared receive queue: post them there".into(),
            ));
        }
        let qp = self.qp;
        // SAFETY: the QP is live (also for the verb in the closure, given a valid request); memory
        // per the contract.
        unsafe {
            post_one_recv(wr_id, sges, self.caps.max_recv_sge, "the QP", "ibv_post_recv", |wr, bad| {
                ffi::ibv_post_recv(qp, wr, bad)
            })
        }
    }
}

/// Posts one request that names no local memory (a zero-length probe) on a QP known by its raw
/// pointer, for a holder that is not the QP's owner (the connection watcher's keepalive).
///
/// # Safety
/// `qp` is a live QP.
///
/// # Errors
/// [`Error::InvalidArgument`] if the request has SGEs; [`Error::Verbs`] if the device refused it.
pub(crate) unsafe fn post_bare_send(qp: *mut ffi::ibv_qp, wr: &SendWr<'_>) -> Result<()> {
    if !wr.sges.is_empty() {
        return Err(Error::InvalidArgument("a bare request names no local memory".into()));
    }
    let mut raw = wr.raw();
    let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
    // SAFETY: the caller's live QP; a single request without SGEs (no local memory).
    let rc = unsafe { ffi::ibv_post_send(qp, &mut raw, &mut bad) };
    if rc != 0 {
        return Err(Error::verbs("ibv_post_send", rc));
    }
    Ok(())
}
