//! The send queue's slot accounting, as posting paths see it while the queue's lock is held.

use crate::error::Result;
use crate::transfer::engine::completion::{Core, Queue, PROBE_OP};

/// The send queue's slot accounting, while its lock is held.
pub(crate) struct SendSlots<'a>(pub(super) &'a mut Queue);

impl SendSlots<'_> {
    /// Slots in use.
    pub(crate) fn used(&self) -> u32 {
        self.0.used
    }

    /// `k` consecutive work-request ids for requests about to be posted; returns the first.
    #[inline(always)]
    pub(crate) fn take_ids(&mut self, k: u64) -> u64 {
        self.0.take_ids(k)
    }

    /// Records `k` requests posted as a chain ending in the signaled `tail`, whose completion
    /// retires `retires` slots (`k`, plus any accepted requests of a partial post before it).
    /// `bytes` is the local memory they name (for the counters).
    pub(crate) fn posted(&mut self, tail: u64, k: u32, retires: u32, op: &'static str, bytes: u64) {
        self.0.used += k;
        self.0.tickets.submitted(tail, retires, op);
        self.0.counts.requests += u64::from(k);
        self.0.counts.bytes += bytes;
    }

    /// Records the connection's own signaled marker `tail` (no memory, not counted as a
    /// request), whose completion retires `retires` slots.
    pub(crate) fn marker_posted(&mut self, tail: u64, retires: u32, op: &'static str) {
        self.0.used += 1;
        self.0.tickets.submitted(tail, retires, op);
    }

    /// Records a keepalive probe `id` (signaled, memory-less, one slot, not counted as a
    /// request); nobody waits for it: its completion is dropped when reaped.
    pub(crate) fn probe_posted(&mut self, id: u64) {
        self.0.used += 1;
        self.0.tickets.submitted(id, 1, PROBE_OP);
    }

    /// Records `k` requests posted without a signaled tail (a partially accepted chain): their
    /// slots are retired by a later tail. `bytes` as in [`SendSlots::posted`].
    pub(crate) fn posted_untracked(&mut self, k: u32, bytes: u64) {
        self.0.used += k;
        self.0.counts.requests += u64::from(k);
        self.0.counts.bytes += bytes;
    }

    /// Reaps the send CQ once.
    pub(crate) fn reap(&mut self, core: &Core) -> Result<usize> {
        core.reap(true, self.0)
    }
}
