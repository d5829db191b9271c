//! Reliable-connected queue pairs: creation, RESET→INIT→RTR→RTS, posting.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::verbs::wr::post_one_recv;
use crate::verbs::Srq;
use crate::verbs::{Access, Cq, Endpoint, Gid, LinkLayer, Mtu, Pd, SendOp, SendWr, Sge};

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

/// Builds an RC [`Qp`] and moves it to INIT.
#[derive(Debug, Clone)]
pub struct QpBuilder {
    pd: Pd,
    send_cq: Cq,
    recv_cq: Cq,
    caps: QpCaps,
    port: Option<u8>,
    gid_index: Option<u32>,
    access: Access,
    srq: Option<Srq>,
}

impl QpBuilder {
    /// Takes receives from `srq` instead of a receive queue of its own (the receive caps are
    /// then ignored, and [`Qp::post_recv`] refuses): post receives with [`Srq::post_recv`];
    /// their completions arrive on the builder's receive CQ, naming this QP. The QP keeps the
    /// queue alive.
    pub fn srq(mut self, srq: &Srq) -> Self {
        self.srq = Some(srq.clone());
        self
    }

    /// Queue sizes (default: 128 deep, 4 SGEs, 64 bytes inline).
    pub fn caps(mut self, caps: QpCaps) -> Self {
        self.caps = caps;
        self
    }

    /// The device port (default: the first ACTIVE port).
    pub fn port(mut self, port: u8) -> Self {
        self.port = Some(port);
        self
    }

    /// The local GID index (default: [`crate::verbs::Context::default_gid_index`]).
    pub fn gid_index(mut self, index: u32) -> Self {
        self.gid_index = Some(index);
        self
    }

    /// What the peer may do through this QP: RDMA WRITE (also write-with-immediate), READ and
    /// atomics *into this side's memory* ([`Access::REMOTE_WRITE`], [`Access::REMOTE_READ`],
    /// [`Access::REMOTE_ATOMIC`]). Default: [`Access::NONE`] — the peer can only SEND; its
    /// one-sided requests are refused by this side's NIC (the peer sees a remote error
    /// completion). A right given here is necessary, not sufficient: the memory region or window
    /// the request names must grant it too. Bits that are not remote rights (`LOCAL_WRITE`,
    /// `MW_BIND`) are ignored, so e.g. [`Access::ALL_REMOTE`] may be passed.
    pub fn remote_access(mut self, access: Access) -> Self {
        self.access = access.remote_only();
        self
    }

    /// Creates the QP and moves it to INIT (receives may then be posted).
    ///
    /// # Errors
    /// - [`Error::NoActiveDevice`] if no port was given and none is `ACTIVE` (or the device cannot
    ///   be queried).
    /// - [`Error::NoSuchIndex`] if the port or GID index does not exist, or (RoCE) the GID entry is
    ///   empty; as [`Context::default_gid_index`](crate::verbs::Context::default_gid_index) when no
    ///   index was given.
    /// - [`Error::Verbs`] if a query, `ibv_create_qp` (e.g. caps above the device limits) or the
    ///   `ibv_modify_qp` to INIT fails (the QP is destroyed then).
    /// - [`Error::DeviceRemoved`] once the device was found removed
    ///   ([`Context::is_removed`](crate::verbs::Context::is_removed)).
    pub fn build(self) -> Result<Qp> {
        let ctx = self.pd.context().clone();
        ctx.usable_for_new()?;
        let port = match self.port {
            Some(p) => p,
            None => ctx
                .first_active_port()
                .ok_or_else(|| Error::NoActiveDevice { available: vec![ctx.name().to_string()] })?,
        };
        let port_info = ctx.port(port)?;
        let gid_index = match self.gid_index {
            Some(i) => i,
            None => ctx.default_gid_index(port)?,
        };
        let gid = ctx.gid(port, gid_index)?;
        if port_info.link_layer == LinkLayer::Ethernet && gid.is_zero() {
            return Err(Error::NoSuchIndex {
                what: "GID index",
                index: gid_index,
                device: ctx.name().to_string(),
                valid: "a populated entry (see Context::gid_table)".into(),
            });
        }
        // SAFETY: ibv_qp_init_attr is plain old data; all-zero is a valid value.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = self.send_cq.as_raw();
        init.recv_cq = self.recv_cq.as_raw();
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        let shared = self.srq.is_some();
        init.cap = ffi::ibv_qp_cap {
            max_send_wr: self.caps.max_send_wr,
            max_recv_wr: if shared { 0 } else { self.caps.max_recv_wr },
            max_send_sge: self.caps.max_send_sge,
            max_recv_sge: if shared { 0 } else { self.caps.max_recv_sge },
            max_inline_data: self.caps.max_inline_data,
        };
        if let Some(srq) = &self.srq {
            if srq.pd() != &self.pd {
                return Err(Error::InvalidArgument("a QP and its shared receive queue must be in the same PD".into()));
            }
            init.srq = srq.as_raw();
        }
        // SAFETY: pd and both CQs are live (we hold them); init is fully initialised.
        let qp = unsafe { ffi::ibv_create_qp(self.pd.as_raw(), &mut init) };
        if qp.is_null() {
            return Err(Error::verbs("ibv_create_qp", 0));
        }
        let caps = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        let mut rng = RandomState::new().build_hasher();
        rng.write_usize(qp as usize);
        let psn = (rng.finish() as u32) & 0xff_ffff;
        let me = Qp {
            qp,
            // SAFETY: qp is live; qp_num is immutable.
            qpn: unsafe { (*qp).qp_num },
            psn,
            port,
            gid_index,
            gid,
            lid: port_info.lid,
            mtu: port_info.active_mtu,
            link_layer: port_info.link_layer,
            caps,
            born: ctx.inner.born,
            pd: self.pd,
            send_cq: self.send_cq,
            recv_cq: self.recv_cq,
            srq: self.srq,
        };
        // SAFETY: ibv_qp_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = self.access.bits();
        use ffi::ibv_qp_attr_mask as M;
        me.modify(&mut attr, M::IBV_QP_STATE.0 | M::IBV_QP_PKEY_INDEX.0 | M::IBV_QP_PORT.0 | M::IBV_QP_ACCESS_FLAGS.0)?;
        Ok(me)
    }
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
    /// Starts building an RC QP in `pd` that completes sends on `send_cq` and receives on
    /// `recv_cq` (they may be the same CQ). The peer gets no remote rights through it unless
    /// [`QpBuilder::remote_access`] grants them.
    pub fn builder(pd: &Pd, send_cq: &Cq, recv_cq: &Cq) -> QpBuilder {
        QpBuilder {
            pd: pd.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            caps: QpCaps::default(),
            port: None,
            gid_index: None,
            access: Access::NONE,
            srq: None,
        }
    }

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
    /// [`Access::LOCAL_WRITE`], and the memory must stay valid and untouched by the CPU until
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
