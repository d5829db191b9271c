//! Creating a connection's queue pair (in INIT) and completion queues from its options.

use crate::error::{Error, Result};
use crate::transfer::liveness::keepalive::MAX_KEEPALIVE;
use crate::transfer::{Connection, Options, WaitMode};
use crate::verbs::{Access, Cq, Pd, Qp};

impl Connection {
    /// Creates the QP (INIT) and CQs for a connection in `pd`.
    pub(crate) fn prepare(pd: &Pd, opts: &Options) -> Result<(Qp, Cq, Cq)> {
        let ctx = pd.context();
        // With a shared receive queue the connection's own receive CQ stays empty (the QP
        // completes receives on the shared receiver's CQ): one entry is enough.
        let recv_depth = if opts.shared_receive.is_some() { 1 } else { opts.qp.recv_depth + 8 };
        let (send_cq, recv_cq) = if matches!(opts.wait.mode, WaitMode::Event) {
            let ch = crate::verbs::CompChannel::new(ctx)?;
            (Cq::with_channel(ctx, opts.qp.send_depth + 8, &ch)?, Cq::with_channel(ctx, recv_depth, &ch)?)
        } else {
            (Cq::new(ctx, opts.qp.send_depth + 8)?, Cq::new(ctx, recv_depth)?)
        };
        let mut b = match &opts.shared_receive {
            Some(shared) => Qp::builder(pd, &send_cq, shared.cq()).srq(shared.srq()),
            None => Qp::builder(pd, &send_cq, &recv_cq),
        };
        if let Some(k) = opts.keepalive.filter(|k| k.is_zero() || *k > MAX_KEEPALIVE) {
            return Err(Error::InvalidArgument(format!("a keepalive interval of {k:?} (0 < keepalive <= 1 day)")));
        }
        // A keepalive probe is a zero-length RDMA WRITE: the QP must accept WRITEs (they
        // reach memory only through a key with write rights).
        let keepalive_access = if opts.keepalive.is_some() { Access::REMOTE_WRITE } else { Access::NONE };
        b = b.caps(opts.qp.caps()).remote_access(opts.qp.remote_access | keepalive_access);
        if let Some(p) = opts.device.port {
            b = b.port(p);
        }
        if let Some(g) = opts.device.gid_index {
            b = b.gid_index(g);
        }
        Ok((b.build()?, send_cq, recv_cq))
    }
}
