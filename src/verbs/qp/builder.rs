//! [`QpBuilder`]: what a queue pair is created with (PD, CQs, capabilities, port, GID, an SRQ,
//! the rights the peer gets), and its creation up to INIT.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::qp::{Qp, QpCaps};
use crate::verbs::{Access, Cq, LinkLayer, Pd, Srq};

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
            access: self.access,
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
}
