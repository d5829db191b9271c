//! Safe wrappers over libibverbs (via `rdma-sys`), one concept per file.
//!
//! Objects are reference counted the way the verbs require: a [`Mr`] or [`Qp`] keeps its [`Pd`]
//! alive, a [`Qp`] keeps its [`Cq`]s alive, and all of them keep their [`Context`] (the opened
//! device) alive. No drop order can free a PD under a live MR or a CQ under a live QP.
//!
//! Posting work requests ([`Qp::post_send`], [`Qp::post_recv`]) is `unsafe` at this layer: the
//! NIC touches the memory after the call returns. The transfer layer makes that safe by owning
//! or borrowing the memory until the completion is reaped.
//!
//! In a `fork()`ed child, the parent's objects refuse every verbs call with
//! [`crate::Error::Forked`] and destroy nothing when dropped (they are the parent's).

mod channel;
mod confine;
mod context;
mod cq;
mod device;
mod endpoint;
mod exposed;
pub(crate) mod liveness;
mod mr;
mod mw;
mod pd;
mod qp;
pub(crate) mod removal;
mod speed;
mod srq;
mod wr;

pub use channel::CompChannel;
pub use context::{Context, GidEntry, LinkLayer, PortInfo, PortState};
pub use cq::{Cq, WcOpcode, WcStatus, WorkCompletion};
pub use device::{devices, numa_node_of, DeviceInfo, NUMA_OVERRIDE};
pub use endpoint::{Endpoint, Gid, Mtu};
pub(crate) use exposed::sealed;
pub use exposed::{Exposable, ExposeFailed, RemoteWritable};
pub(crate) use mr::{keep_for_good, release as release_registered, LEAKED_MAPPINGS};
pub use mr::{Access, Mr, RegisteredBuf};
pub use srq::Srq;

/// How many registered mappings (heap chunks, registered buffers, mapped files — and heap
/// buffers whose own key could not be revoked) this process leaked because the device refused
/// to deregister them (`ibv_dereg_mr` failed, e.g. while a
/// memory window was bound): they stay mapped and pinned rather than be reused under the NIC.
pub fn leaked_mappings() -> u64 {
    LEAKED_MAPPINGS.load(std::sync::atomic::Ordering::Relaxed)
}
pub use mw::Mw;
pub use pd::Pd;
pub(crate) use qp::{post_bare_send, retry_time, set_qp_error};
pub use qp::{ConnectOptions, Qp, QpBuilder, QpCaps, QpState};
pub use wr::{RemoteAddr, SendFlags, SendOp, SendWr, Sge, Verb};
