//! What a connection's completion state holds — buffers of abandoned operations, memory kept
//! until the connection's close — and its counters: what closing and dropping a connection ask.

use crate::transfer::engine::completion::{Core, Parked};
use crate::transfer::engine::stats::ConnectionStats;

impl Core {
    /// Keeps `buf` until the connection is closed: dropped by the connection's drop once its
    /// queue pair is in the error state and flushed (after which it serves no remote access),
    /// or leaked if the flush never comes.
    pub(crate) fn park_until_closed(&self, buf: Parked) {
        self.until_closed.lock().push(buf);
    }

    /// The connection's counters now.
    pub(crate) fn stats(&self) -> ConnectionStats {
        let (send, send_used) = {
            let q = self.send.lock();
            (q.counts, q.used)
        };
        let q = self.recv.lock();
        ConnectionStats::from_queues(send, send_used, q.counts, q.used)
    }

    /// Whether the signaled send-queue request `wr_id` is still waiting for its completion.
    pub(crate) fn send_in_flight(&self, wr_id: u64) -> bool {
        self.send.lock().tickets.in_flight(wr_id)
    }

    /// Whether no request is outstanding on either queue and nothing is parked.
    pub(crate) fn quiet(&self) -> bool {
        let s = self.send.lock();
        let r = self.recv.lock();
        s.used == 0 && r.used == 0 && !s.tickets.any_abandoned() && !r.tickets.any_abandoned()
    }

    /// Whether buffers wait for completions not yet reaped (someone must keep reaping).
    #[cfg(feature = "tokio")]
    pub(crate) fn has_parked(&self) -> bool {
        self.send.lock().tickets.any_abandoned() || self.recv.lock().tickets.any_abandoned()
    }

    /// Takes every buffer still held (parked, or kept until the connection is closed).
    pub(crate) fn take_held(&self) -> Vec<Parked> {
        let mut all = self.send.lock().tickets.take_abandoned();
        all.extend(self.recv.lock().tickets.take_abandoned());
        all.append(&mut self.until_closed.lock());
        all.append(&mut self.deferred.lock());
        all
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        // The connection takes every held buffer after closing or destroying its QP. Anything here
        // means that did not happen (a panic on the way): the NIC may still use it, so leak it.
        let held = self.take_held();
        if !held.is_empty() {
            let n = held.len();
            std::mem::forget(held); // leaked before anything else runs (a logger may panic)
            tracing::error!("a connection's completion state went away holding {n} buffers; leaking them");
        }
    }
}
