//! [`Link`]: what the liveness thread holds of one connection — its completion state, its
//! queue pair (until the connection destroys it) and its keepalive — to fail it or probe it.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rdma_sys as ffi;

use crate::error::Disconnect;
use crate::transfer::engine::completion::{Core, Failure};
use crate::transfer::liveness::keepalive::{Keepalive, Tick};
use crate::verbs::{post_bare_send, set_qp_error, Qp};

/// What the watcher needs to fail one connection: its completion state and its QP, the latter
/// until the connection destroys it ([`Link::retire`]).
pub(crate) struct Link {
    core: Arc<Core>,
    qp: Mutex<Option<RawQp>>,
    /// Identities for matching device events (pointers compared, never dereferenced); the
    /// device is the entry's.
    qp_ptr: usize,
    cqs: [usize; 2],
    port: u8,
    /// Probes the peer, if the connection asked for keepalive.
    keepalive: Option<Keepalive>,
}

#[derive(Clone, Copy)]
struct RawQp(*mut ffi::ibv_qp);

// SAFETY: the pointer is only used (ibv_modify_qp, thread-safe) under the link's lock, and
// `Link::retire` takes it away before the QP is destroyed.
unsafe impl Send for RawQp {}

impl Link {
    pub(crate) fn new(core: &Arc<Core>, qp: &Qp, keepalive: Option<Keepalive>) -> Link {
        Link {
            core: core.clone(),
            qp: Mutex::new(Some(RawQp(qp.as_raw()))),
            qp_ptr: qp.as_raw() as usize,
            cqs: [core.cqs().0.as_raw() as usize, core.cqs().1.as_raw() as usize],
            port: qp.port(),
            keepalive,
        }
    }

    /// Whether a device event naming the QP at `qp` (an address, compared only) concerns it.
    pub(super) fn has_qp(&self, qp: usize) -> bool {
        self.qp_ptr == qp
    }

    /// Whether a device event naming the CQ at `cq` concerns it.
    pub(super) fn has_cq(&self, cq: usize) -> bool {
        self.cqs.contains(&cq)
    }

    /// Whether it uses port `port` of its device.
    pub(super) fn on_port(&self, port: u8) -> bool {
        self.port == port
    }

    /// Whether it probes its peer (keepalive).
    pub(super) fn probes(&self) -> bool {
        self.keepalive.is_some()
    }

    /// Fails the connection with `why` (unless it failed already) and moves its QP to the error
    /// state, so that everything outstanding is flushed.
    pub(crate) fn fail(&self, why: Disconnect) {
        if !self.core.fail(Failure::Lost(why)) {
            return;
        }
        tracing::info!(target: "mralloc::transfer", qp = self.qp_ptr, "connection lost: {why}");
        self.set_error();
    }

    /// Moves the QP (if the connection still has it) to the error state, flushing everything
    /// outstanding.
    fn set_error(&self) {
        if let Some(qp) = *self.qp.lock() {
            // SAFETY: the QP lives until `retire`, which waits for this lock.
            if let Err(e) = unsafe { set_qp_error(qp.0) } {
                tracing::error!("moving a lost connection's QP to the error state failed: {e}");
            }
        }
    }

    /// Runs the connection's keepalive schedule (see [`Keepalive::tick`]); returns when to run
    /// it next (`None`: no keepalive, or the connection failed).
    pub(super) fn keepalive(&self, now: Instant) -> Option<Instant> {
        let tick = self.keepalive.as_ref()?.tick(&self.core, now, |wr| {
            let Some(qp) = *self.qp.lock() else { return Ok(false) };
            // SAFETY: the QP lives until `retire`, which waits for this lock; the request names
            // no memory.
            unsafe { post_bare_send(qp.0, wr) }.map(|()| true)
        })?;
        match tick {
            Tick::At(t) => Some(t),
            Tick::Failed => {
                match self.core.failure() {
                    // Closed by its owner, who flushes it: nothing lost.
                    Some(Failure::Closed) => {}
                    Some(f @ Failure::Lost(_)) => {
                        tracing::info!(target: "mralloc::transfer", qp = self.qp_ptr, "connection lost: {}", f.error());
                        self.set_error();
                    }
                    // The connection's own failure (logged where it was recorded).
                    Some(_) | None => self.set_error(),
                }
                None
            }
        }
    }

    /// The connection is about to destroy its QP: the watcher must not touch it any more (and
    /// a keepalive tick under way is over before the connection takes back what it holds).
    pub(crate) fn retire(&self) {
        if let Some(k) = &self.keepalive {
            k.retire();
        }
        *self.qp.lock() = None;
    }
}
