//! Completion queues and typed work completions.

use std::ffi::CStr;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::clock::{Stopwatch, BUSY};
use crate::error::{Error, Result};
use crate::fork::Born;
use crate::verbs::{CompChannel, Context};

macro_rules! wc_statuses {
    ($($variant:ident = $raw:ident, $name:literal;)*) => {
        /// Status of a work completion (`IBV_WC_*`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum WcStatus {
            $(
                #[doc = concat!("`IBV_WC_", $name, "`")]
                $variant,
            )*
            /// A status this build does not know.
            Unknown(u32),
        }

        impl WcStatus {
            /// From the raw `ibv_wc_status` value.
            pub fn from_raw(raw: u32) -> WcStatus {
                match raw {
                    $(ffi::ibv_wc_status::$raw => WcStatus::$variant,)*
                    other => WcStatus::Unknown(other),
                }
            }

            /// The verbs name without prefix, e.g. `"REM_ACCESS_ERR"`.
            pub fn name(self) -> &'static str {
                match self {
                    $(WcStatus::$variant => $name,)*
                    WcStatus::Unknown(_) => "UNKNOWN",
                }
            }
        }
    };
}

wc_statuses! {
    Success = IBV_WC_SUCCESS, "SUCCESS";
    LocLenErr = IBV_WC_LOC_LEN_ERR, "LOC_LEN_ERR";
    LocQpOpErr = IBV_WC_LOC_QP_OP_ERR, "LOC_QP_OP_ERR";
    LocEecOpErr = IBV_WC_LOC_EEC_OP_ERR, "LOC_EEC_OP_ERR";
    LocProtErr = IBV_WC_LOC_PROT_ERR, "LOC_PROT_ERR";
    WrFlushErr = IBV_WC_WR_FLUSH_ERR, "WR_FLUSH_ERR";
    MwBindErr = IBV_WC_MW_BIND_ERR, "MW_BIND_ERR";
    BadRespErr = IBV_WC_BAD_RESP_ERR, "BAD_RESP_ERR";
    LocAccessErr = IBV_WC_LOC_ACCESS_ERR, "LOC_ACCESS_ERR";
    RemInvReqErr = IBV_WC_REM_INV_REQ_ERR, "REM_INV_REQ_ERR";
    RemAccessErr = IBV_WC_REM_ACCESS_ERR, "REM_ACCESS_ERR";
    RemOpErr = IBV_WC_REM_OP_ERR, "REM_OP_ERR";
    RetryExcErr = IBV_WC_RETRY_EXC_ERR, "RETRY_EXC_ERR";
    RnrRetryExcErr = IBV_WC_RNR_RETRY_EXC_ERR, "RNR_RETRY_EXC_ERR";
    LocRddViolErr = IBV_WC_LOC_RDD_VIOL_ERR, "LOC_RDD_VIOL_ERR";
    RemInvRdReqErr = IBV_WC_REM_INV_RD_REQ_ERR, "REM_INV_RD_REQ_ERR";
    RemAbortErr = IBV_WC_REM_ABORT_ERR, "REM_ABORT_ERR";
    InvEecnErr = IBV_WC_INV_EECN_ERR, "INV_EECN_ERR";
    InvEecStateErr = IBV_WC_INV_EEC_STATE_ERR, "INV_EEC_STATE_ERR";
    FatalErr = IBV_WC_FATAL_ERR, "FATAL_ERR";
    RespTimeoutErr = IBV_WC_RESP_TIMEOUT_ERR, "RESP_TIMEOUT_ERR";
    GeneralErr = IBV_WC_GENERAL_ERR, "GENERAL_ERR";
}

impl WcStatus {
    /// libibverbs' description (`ibv_wc_status_str`).
    pub fn description(self) -> String {
        let raw = match self {
            WcStatus::Unknown(r) => r,
            // The discriminant order mirrors IBV_WC_* for the known statuses.
            known => (0..=ffi::ibv_wc_status::IBV_WC_GENERAL_ERR)
                .find(|&r| WcStatus::from_raw(r) == known)
                .unwrap_or(u32::MAX),
        };
        // SAFETY: ibv_wc_status_str accepts any value and returns a static string.
        let p = unsafe { ffi::ibv_wc_status_str(raw) };
        if p.is_null() {
            return self.name().to_string();
        }
        // SAFETY: p is a static NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Opcode of a work completion (`IBV_WC_*` opcodes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND finished on the sending side.
    Send,
    /// An RDMA WRITE finished.
    RdmaWrite,
    /// An RDMA READ finished (data is in local memory).
    RdmaRead,
    /// A compare-and-swap finished.
    CompareSwap,
    /// A fetch-and-add finished.
    FetchAdd,
    /// A memory window bind finished.
    BindMw,
    /// A local invalidate finished.
    LocalInv,
    /// A receive buffer was filled by a SEND.
    Recv,
    /// An RDMA WRITE with immediate consumed a receive.
    RecvRdmaWithImm,
    /// Any other value.
    Other(u32),
}

impl WcOpcode {
    /// From the raw `ibv_wc_opcode` value.
    pub fn from_raw(raw: u32) -> WcOpcode {
        use ffi::ibv_wc_opcode::*;
        match raw {
            IBV_WC_SEND => WcOpcode::Send,
            IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            IBV_WC_COMP_SWAP => WcOpcode::CompareSwap,
            IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            IBV_WC_BIND_MW => WcOpcode::BindMw,
            IBV_WC_LOCAL_INV => WcOpcode::LocalInv,
            IBV_WC_RECV => WcOpcode::Recv,
            IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            other => WcOpcode::Other(other),
        }
    }
}

/// One work completion, laid out exactly as `ibv_wc` so that polling writes straight into the
/// caller's slice.
#[repr(transparent)]
pub struct WorkCompletion(ffi::ibv_wc);

const IBV_WC_WITH_IMM: u32 = 1 << 1;

impl WorkCompletion {
    /// An empty entry to poll into.
    pub fn empty() -> WorkCompletion {
        // SAFETY: ibv_wc is plain old data; all-zero is a valid value.
        WorkCompletion(unsafe { std::mem::zeroed() })
    }

    /// A buffer of `n` empty entries.
    pub fn buffer(n: usize) -> Vec<WorkCompletion> {
        (0..n).map(|_| WorkCompletion::empty()).collect()
    }

    /// The `wr_id` the request was posted with.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// Completion status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.0.status)
    }

    /// Whether the request succeeded.
    pub fn is_ok(&self) -> bool {
        self.0.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// Completion opcode (valid for successful completions).
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode::from_raw(self.0.opcode)
    }

    /// Bytes received (receives) or transferred (READ/atomics).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// Immediate data (host order), when the sender attached some.
    pub fn imm(&self) -> Option<u32> {
        if self.0.wc_flags & IBV_WC_WITH_IMM != 0 {
            // SAFETY: with IBV_WC_WITH_IMM set, the union holds imm_data; reading a u32 from
            // either member is valid for any bit pattern.
            Some(u32::from_be(unsafe { self.0.imm_data_invalidated_rkey_union.imm_data }))
        } else {
            None
        }
    }

    /// Provider-specific error detail.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }

    /// Number of the local QP the completion belongs to.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// `Ok(self)` when successful, else the typed [`Error::WorkCompletion`].
    ///
    /// # Errors
    /// [`Error::WorkCompletion`] (with its `wr_id`, status, opcode and vendor error) if the status
    /// is not `SUCCESS`.
    pub fn ok(&self) -> Result<&WorkCompletion> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(self.to_error())
        }
    }

    /// The completion as an [`Error::WorkCompletion`] (whatever its status).
    pub fn to_error(&self) -> Error {
        Error::WorkCompletion {
            wr_id: self.wr_id(),
            status: self.status(),
            opcode: self.opcode(),
            vendor_err: self.vendor_err(),
        }
    }
}

impl std::fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status().name())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("imm", &self.imm())
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

pub(crate) struct CqInner {
    pub(crate) cq: *mut ffi::ibv_cq,
    pub(crate) ctx: Context,
    /// The context's: checked on every poll (a fork()ed child must not use the parent's CQ).
    pub(crate) born: Born,
    pub(crate) depth: u32,
    /// Dropped after the CQ is destroyed (field order after Drop::drop).
    pub(crate) _channel: Option<CompChannel>,
}

// SAFETY: ibv_poll_cq and ibv_destroy_cq may be called from any thread (providers lock the CQ);
// the pointer is only freed in Drop.
unsafe impl Send for CqInner {}
// SAFETY: see Send.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        if !self.born.here() {
            return; // the parent's (a fork()ed child's copy)
        }
        // SAFETY: cq came from ibv_create_cq; QPs using it hold an Arc, so none is alive.
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq) };
        if rc != 0 {
            tracing::warn!(device = %self.ctx.name(), rc, "ibv_destroy_cq failed");
        }
    }
}

/// A completion queue. Cheap to clone; queue pairs keep their CQs alive.
#[derive(Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cq").field("device", &self.inner.ctx.name()).field("depth", &self.inner.depth).finish()
    }
}

impl Cq {
    /// Creates a CQ with room for at least `depth` completions.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `depth` is 0 or above `i32::MAX`.
    /// - [`Error::Verbs`] if `ibv_create_cq` fails (e.g. `EINVAL` above the device's CQ size).
    /// - [`Error::DeviceRemoved`] once the device was found removed ([`Context::is_removed`]).
    pub fn new(ctx: &Context, depth: u32) -> Result<Cq> {
        Cq::create(ctx, depth, None)
    }

    /// Creates a CQ that raises events on `channel` when armed (see [`Cq::arm`]).
    ///
    /// # Errors
    /// As [`Cq::new`].
    pub fn with_channel(ctx: &Context, depth: u32, channel: &CompChannel) -> Result<Cq> {
        Cq::create(ctx, depth, Some(channel.clone()))
    }

    fn create(ctx: &Context, depth: u32, channel: Option<CompChannel>) -> Result<Cq> {
        ctx.usable_for_new()?;
        if depth == 0 || depth > i32::MAX as u32 {
            return Err(Error::InvalidArgument(format!("CQ depth {depth} out of range")));
        }
        let ch = channel.as_ref().map_or(std::ptr::null_mut(), CompChannel::as_raw);
        // SAFETY: ctx is live; the channel (if any) is kept alive by the CQ.
        let cq = unsafe { ffi::ibv_create_cq(ctx.as_raw(), depth as i32, std::ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(Error::verbs("ibv_create_cq", 0));
        }
        // SAFETY: cq is live; cqe is the actual capacity the provider chose.
        let actual = unsafe { (*cq).cqe }.max(0) as u32;
        Ok(Cq {
            inner: Arc::new(CqInner { cq, born: ctx.inner.born, ctx: ctx.clone(), depth: actual, _channel: channel }),
        })
    }

    /// The completion channel the CQ raises events on, if any.
    pub fn channel(&self) -> Option<&CompChannel> {
        self.inner._channel.as_ref()
    }

    /// Requests an event on the CQ's channel for the next completion (`ibv_req_notify_cq`).
    /// Poll once more after arming: completions that arrived before it raise no event.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_req_notify_cq` fails.
    pub fn arm(&self) -> Result<()> {
        self.usable()?;
        // SAFETY: the CQ is live.
        let rc = unsafe { ffi::ibv_req_notify_cq(self.inner.cq, 0) };
        if rc != 0 {
            return Err(Error::verbs("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Capacity actually allocated (≥ the requested depth).
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// The raw `ibv_cq`, valid while this `Cq` lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.cq
    }

    /// [`Error::Forked`] in a fork()ed child of the process that made the CQ.
    #[inline(always)]
    pub(crate) fn usable(&self) -> Result<()> {
        self.inner.born.check("this completion queue")
    }

    /// Polls once, without waiting: fills the front of `out` and returns how many it filled.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_poll_cq` returns a negative value (its errno is taken to be that
    /// value negated). Failed completions are not errors: check each entry's status.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.usable()?;
        let n = out.len().min(i32::MAX as usize) as i32;
        // SAFETY: the CQ is live; WorkCompletion is repr(transparent) over ibv_wc, so `out` is
        // `n` writable ibv_wc slots.
        let rc = unsafe { ffi::ibv_poll_cq(self.inner.cq, n, out.as_mut_ptr().cast()) };
        if rc < 0 {
            return Err(Error::verbs("ibv_poll_cq", -rc));
        }
        Ok(rc as usize)
    }

    /// Busy-polls until at least one completion arrives or `timeout` passes.
    ///
    /// # Errors
    /// - As [`Cq::poll`].
    /// - [`Error::Timeout`] if nothing arrived within `timeout`.
    pub fn poll_wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        // A completion found at once costs no clock read (a system call on some VMs).
        let mut watch = Stopwatch::new(BUSY);
        let mut spins = 0u32;
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            if watch.elapsed() >= timeout {
                return Err(Error::Timeout(timeout, "a work completion"));
            }
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Waits for exactly one completion and returns it, successful or not.
    ///
    /// # Errors
    /// As [`Cq::poll_wait`]. A failed completion is returned, not an error
    /// ([`WorkCompletion::ok`] converts it).
    pub fn next(&self, timeout: Duration) -> Result<WorkCompletion> {
        let mut wc = [WorkCompletion::empty()];
        self.poll_wait(&mut wc, timeout)?;
        let [wc] = wc;
        Ok(wc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_and_round_trip() {
        assert_eq!(WcStatus::from_raw(10), WcStatus::RemAccessErr);
        assert_eq!(WcStatus::RemAccessErr.name(), "REM_ACCESS_ERR");
        assert_eq!(WcStatus::from_raw(0).name(), "SUCCESS");
        assert_eq!(WcStatus::from_raw(999), WcStatus::Unknown(999));
        for raw in 0..=21 {
            assert_ne!(WcStatus::from_raw(raw).name(), "UNKNOWN", "status {raw}");
        }
    }

    #[test]
    fn completion_to_error() {
        let mut wc = WorkCompletion::empty();
        wc.0.wr_id = 42;
        wc.0.status = ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
        assert!(!wc.is_ok());
        let e = wc.ok().unwrap_err();
        assert_eq!(e.wc_status(), Some(WcStatus::RemAccessErr));
        assert!(e.to_string().contains("REM_ACCESS_ERR"), "{e}");
        assert!(e.to_string().contains("work request 42"), "{e}");
    }

    #[test]
    fn immediate_only_with_flag() {
        let mut wc = WorkCompletion::empty();
        wc.0.imm_data_invalidated_rkey_union.imm_data = 0x1234_5678u32.to_be();
        assert_eq!(wc.imm(), None);
        wc.0.wc_flags = IBV_WC_WITH_IMM;
        assert_eq!(wc.imm(), Some(0x1234_5678));
    }
}
