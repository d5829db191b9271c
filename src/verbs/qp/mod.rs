//! Reliable-connected queue pairs: the `Qp` handle, its state changes (INIT→RTR→RTS, error) and
//! queries. Creation up to INIT is `builder.rs`; posting work requests is `post.rs`.

use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::verbs::Srq;
use crate::verbs::{Access, Cq, Endpoint, Gid, LinkLayer, Mtu, Pd};

mod builder;
mod post;
pub use builder::QpBuilder;
pub(crate) use post::post_bare_send;

/// Sizes of a queue pair's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send-queue work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Bytes that may be sent inline.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> QpCaps {
        QpCaps { max_send_wr: 128, max_recv_wr: 128, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 64 }
    }
}

/// How the QP behaves once connected: retries, timeouts, RDMA-read depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms). 0 means infinite; avoid.
    pub timeout: u8,
    /// Transport retries (0-7, default 7) before a request fails with `RETRY_EXC_ERR`.
    /// Soft-RoCE (`rdma_rxe`) takes 7 as "retry forever", against the specification.
    pub retry_cnt: u8,
    /// RNR retries (0-7; 7 = forever, as perftest uses) when the peer has no receive posted.
    pub rnr_retry: u8,
    /// RNR NAK delay code this side asks senders to wait (12 ≈ 0.64 ms).
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READ/atomic requests this side initiates (capped by the device; the
    /// default asks for the device maximum, as perftest does).
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READ/atomic requests this side serves (capped by the device).
    pub max_dest_rd_atomic: u8,
    /// Hop limit of the GRH (RoCE v2: the IP TTL).
    pub hop_limit: u8,
}

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions {
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: u8::MAX,
            max_dest_rd_atomic: u8::MAX,
            hop_limit: 64,
        }
    }
}

/// QP state (`IBV_QPS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Just created, or reset.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send: fully connected.
    ReadyToSend,
    /// Send queue drained.
    SendQueueDrained,
    /// Send queue error.
    SendQueueError,
    /// Error: every outstanding and later request completes with `WR_FLUSH_ERR`.
    Error,
    /// Anything else.
    Unknown(u32),
}

/// A reliable-connected queue pair.
///
/// Keeps its PD and CQs alive. Posting is `unsafe` at this layer: the NIC reads and writes the
/// posted memory asynchronously, after the call returns. The transfer layer builds safe,
/// ownership-tracking operations on top.
pub struct Qp {
    qp: *mut ffi::ibv_qp,
    qpn: u32,
    psn: u32,
    port: u8,
    gid_index: u32,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
    link_layer: LinkLayer,
    caps: QpCaps,
    /// The rights the peer has through it (what [`QpBuilder::remote_access`] set at INIT).
    access: Access,
    pd: Pd,
    send_cq: Cq,
    recv_cq: Cq,
    /// The shared receive queue its receives come from, if any (kept alive by the QP).
    srq: Option<Srq>,
    /// The context's: checked on every post (a fork()ed child must not use the parent's QP).
    born: Born,
}

// SAFETY: libibverbs providers serialise posting and state changes on a QP internally; the
// pointer is destroyed only in Drop.
unsafe impl Send for Qp {}
// SAFETY: see Send.
unsafe impl Sync for Qp {}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.qpn)
            .field("device", &self.pd.context().name())
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .finish()
    }
}

/// The transport's nominal retry time for an ACK timeout exponent and a retry count:
/// `(retry_cnt + 1) × 4.096 µs × 2^timeout`.
pub(crate) fn retry_time(timeout: u8, retry_cnt: u8) -> Duration {
    Duration::from_nanos(4096 << timeout.min(31)) * (u32::from(retry_cnt.min(7)) + 1)
}

impl Qp {
    /// This QP's connection details, to hand to the peer.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint { qpn: self.qpn, psn: self.psn, gid: self.gid, lid: self.lid, mtu: self.mtu }
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The queue sizes the device granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// What the peer may do into this side's memory through this QP (the remote rights it was
    /// built with, [`QpBuilder::remote_access`]; [`Access::NONE`] if none).
    pub fn remote_access(&self) -> Access {
        self.access
    }

    /// The PD.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &Cq {
        &self.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &Cq {
        &self.recv_cq
    }

    /// The fork generation the QP was made in.
    pub(crate) fn born(&self) -> Born {
        self.born
    }

    /// [`Error::Forked`] in a fork()ed child of the process that made the QP.
    #[inline(always)]
    fn usable(&self) -> Result<()> {
        self.born.check("this queue pair")
    }

    /// The shared receive queue its receives come from, if it was built with one.
    pub(crate) fn srq(&self) -> Option<&Srq> {
        self.srq.as_ref()
    }

    /// The raw `ibv_qp`, valid while this `Qp` lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.qp
    }

    fn modify(&self, attr: &mut ffi::ibv_qp_attr, mask: u32) -> Result<()> {
        self.usable()?;
        // SAFETY: qp is live; attr is fully initialised for the fields named by mask.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask as i32) };
        if rc != 0 {
            return Err(Error::verbs("ibv_modify_qp", rc));
        }
        Ok(())
    }

    /// Connects to `remote`: INIT → RTR → RTS.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_query_device` fails, or `ibv_modify_qp` refuses the move to RTR
    /// or to RTS (e.g. `EINVAL` for a bad remote endpoint, port, GID index or MTU). A refused move
    /// to RTS leaves the QP in RTR.
    pub fn connect(&self, remote: &Endpoint, opts: &ConnectOptions) -> Result<()> {
        let dev = self.pd.context().attributes()?;
        let rd_atomic = opts.max_rd_atomic.min(dev.max_qp_rd_atom.clamp(1, 255) as u8).max(1);
        let dest_rd_atomic = opts.max_dest_rd_atomic.min(dev.max_qp_init_rd_atom.clamp(1, 255) as u8).max(1);
        use ffi::ibv_qp_attr_mask as M;

        // SAFETY: ibv_qp_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = self.mtu.min(remote.mtu).to_raw();
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = dest_rd_atomic;
        attr.min_rnr_timer = opts.min_rnr_timer;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = self.port;
        if self.link_layer == LinkLayer::Ethernet || !remote.gid.is_zero() {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = *remote.gid.as_bytes();
            attr.ah_attr.grh.sgid_index = self.gid_index as u8;
            attr.ah_attr.grh.hop_limit = opts.hop_limit;
            attr.ah_attr.grh.flow_label = 0;
            attr.ah_attr.grh.traffic_class = 0;
        }
        self.modify(
            &mut attr,
            M::IBV_QP_STATE.0
                | M::IBV_QP_AV.0
                | M::IBV_QP_PATH_MTU.0
                | M::IBV_QP_DEST_QPN.0
                | M::IBV_QP_RQ_PSN.0
                | M::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | M::IBV_QP_MIN_RNR_TIMER.0,
        )?;

        // SAFETY: as above.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = opts.timeout;
        attr.retry_cnt = opts.retry_cnt.min(7);
        attr.rnr_retry = opts.rnr_retry.min(7);
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = rd_atomic;
        self.modify(
            &mut attr,
            M::IBV_QP_STATE.0
                | M::IBV_QP_TIMEOUT.0
                | M::IBV_QP_RETRY_CNT.0
                | M::IBV_QP_RNR_RETRY.0
                | M::IBV_QP_SQ_PSN.0
                | M::IBV_QP_MAX_QP_RD_ATOMIC.0,
        )
    }

    /// Moves the QP to the error state: outstanding requests complete with `WR_FLUSH_ERR`.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_modify_qp` fails.
    pub fn set_error(&self) -> Result<()> {
        self.usable()?;
        // SAFETY: the QP is live.
        unsafe { set_qp_error(self.qp) }
    }

    /// The port the QP was created on.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The local GID index the QP was created with.
    pub fn gid_index(&self) -> u32 {
        self.gid_index
    }

    /// The current state, as the device reports it.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_query_qp` fails.
    pub fn state(&self) -> Result<QpState> {
        let attr = self.query(ffi::ibv_qp_attr_mask::IBV_QP_STATE)?;
        use ffi::ibv_qp_state::*;
        Ok(match attr.qp_state {
            IBV_QPS_RESET => QpState::Reset,
            IBV_QPS_INIT => QpState::Init,
            IBV_QPS_RTR => QpState::ReadyToReceive,
            IBV_QPS_RTS => QpState::ReadyToSend,
            IBV_QPS_SQD => QpState::SendQueueDrained,
            IBV_QPS_SQE => QpState::SendQueueError,
            IBV_QPS_ERR => QpState::Error,
            other => QpState::Unknown(other),
        })
    }

    /// How long the transport retries an unanswered request before completing it with
    /// `RETRY_EXC_ERR`, from the QP's own attributes: `(retry_cnt + 1) × 4.096 µs × 2^timeout`
    /// (nominal: the specification lets a device's timer run up to 4 times longer). A `timeout`
    /// of 0 means the device never times out: then the result is the nominal minimum.
    pub(crate) fn retry_time(&self) -> Result<Duration> {
        let attr = self.query(ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT)?;
        Ok(retry_time(attr.timeout, attr.retry_cnt))
    }

    /// The GID the QP addresses its peer at (its address vector's destination GID, set when it
    /// was connected: what an RDMA CM connection learned from its route); `None` without a
    /// global route header (InfiniBand within a subnet).
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_query_qp` fails.
    pub(crate) fn remote_gid(&self) -> Result<Option<Gid>> {
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok(self.global_route()?.map(|grh| Gid::from_bytes(unsafe { grh.dgid.raw })))
    }

    /// The GID the QP sends from (its address vector's source GID index, looked up in the port's
    /// table: what its peer addresses it by; an RDMA CM connection's comes from the CM's route,
    /// not from the GID index the QP was made with); the endpoint's GID without a global route.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_query_qp` or the GID lookup fails.
    pub(crate) fn local_gid(&self) -> Result<Gid> {
        match self.global_route()? {
            Some(grh) => self.pd.context().gid(self.port(), u32::from(grh.sgid_index)),
            None => Ok(self.endpoint().gid),
        }
    }

    /// The global route header of the QP's address vector, if it has one.
    fn global_route(&self) -> Result<Option<ffi::ibv_global_route>> {
        let attr = self.query(ffi::ibv_qp_attr_mask::IBV_QP_AV)?;
        Ok((attr.ah_attr.is_global != 0).then_some(attr.ah_attr.grh))
    }

    /// `ibv_query_qp` of the attributes `mask` names.
    fn query(&self, mask: ffi::ibv_qp_attr_mask) -> Result<ffi::ibv_qp_attr> {
        self.usable()?;
        // SAFETY: both structs are plain old data; all-zero is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: qp is live; both out-pointers are valid.
        let rc = unsafe { ffi::ibv_query_qp(self.qp, &mut attr, mask.0 as i32, &mut init) };
        if rc != 0 {
            return Err(Error::verbs("ibv_query_qp", rc));
        }
        Ok(attr)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if !self.born.here() {
            return; // the parent's (a fork()ed child's copy)
        }
        // SAFETY: qp came from ibv_create_qp and is destroyed once; PD and CQs are still alive
        // (we hold clones, dropped after this).
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::warn!(qpn = self.qpn, rc, "ibv_destroy_qp failed");
        }
    }
}

/// Moves a QP to the error state (what [`Qp::set_error`] does), for a holder of its raw
/// pointer that is not the QP's owner (the connection watcher).
///
/// # Safety
/// `qp` is a live QP.
pub(crate) unsafe fn set_qp_error(qp: *mut ffi::ibv_qp) -> Result<()> {
    // SAFETY: an all-zero ibv_qp_attr is valid; only qp_state is read (the mask).
    let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
    // SAFETY: the caller's live QP; attr is initialised for the masked field.
    let rc = unsafe { ffi::ibv_modify_qp(qp, &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) };
    if rc != 0 {
        return Err(Error::verbs("ibv_modify_qp", rc));
    }
    Ok(())
}
