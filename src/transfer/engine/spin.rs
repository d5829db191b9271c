//! The short, adaptive poll a wait makes before it sleeps: an async future's, and a blocking
//! wait's in [`WaitMode::Event`](crate::transfer::WaitMode::Event).
//!
//! Sleeping costs a completion-channel event and a wake-up (for a future also a reactor turn
//! and a task switch): several microseconds on real hardware, far more than a small RDMA
//! operation takes. So a wait whose request is not complete at its first poll polls the CQ for
//! a while first. How long adapts per connection and per queue: an average of how long recent
//! operations that had to wait took from that first poll to their completion, times 1.5,
//! capped at [`WaitOptions::spin`](crate::transfer::WaitOptions::spin). Operations that take longer
//! than the cap (a receive waiting for a quiet peer) stop spinning altogether, so an idle
//! server sleeps instead of burning a core.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The longest [`WaitOptions::spin`](crate::transfer::WaitOptions::spin) is honoured.
pub(crate) const MAX_SPIN: Duration = Duration::from_millis(1);

pub(crate) struct Spin {
    cap_ns: u64,
    /// Moving averages (1/8 weight per sample) of the wait from the first poll that found the
    /// request incomplete to its completion, in ns.
    send_ns: AtomicU64,
    recv_ns: AtomicU64,
    /// Per queue (send, receive): a spin ran out without its completion, and no completion
    /// was claimed since. Futures polled for the first time meanwhile (a `join_all` over many
    /// receives from a quiet peer) sleep at once instead of spinning one after another.
    expired: [AtomicBool; 2],
}

impl Spin {
    pub(crate) fn new(cap: Duration) -> Spin {
        // Spinning holds a thread (an executor's, for a future): never longer than MAX_SPIN,
        // whatever was asked.
        let cap_ns = u64::try_from(cap.min(MAX_SPIN).as_nanos()).unwrap_or(u64::MAX);
        // Start in the middle: the first operations spin, and the average settles from there.
        Spin {
            cap_ns,
            send_ns: AtomicU64::new(cap_ns / 2),
            recv_ns: AtomicU64::new(cap_ns / 2),
            expired: [AtomicBool::new(false), AtomicBool::new(false)],
        }
    }

    fn avg(&self, send: bool) -> &AtomicU64 {
        if send {
            &self.send_ns
        } else {
            &self.recv_ns
        }
    }

    /// How long to poll before sleeping, counted from the first poll that found the request
    /// incomplete.
    pub(crate) fn budget(&self, send: bool) -> Duration {
        let avg = self.avg(send).load(Ordering::Relaxed);
        if self.cap_ns == 0 || avg > self.cap_ns || self.expired[usize::from(send)].load(Ordering::Relaxed) {
            return Duration::ZERO;
        }
        Duration::from_nanos((avg + avg / 2).min(self.cap_ns))
    }

    /// A spin on this queue ran out without its completion.
    pub(crate) fn expire(&self, send: bool) {
        self.expired[usize::from(send)].store(true, Ordering::Relaxed);
    }

    /// A completion on this queue was claimed: spinning may pay again.
    #[inline]
    pub(crate) fn claimed(&self, send: bool) {
        let e = &self.expired[usize::from(send)];
        // Load first: the common case writes nothing (no cache-line traffic between threads).
        if e.load(Ordering::Relaxed) {
            e.store(false, Ordering::Relaxed);
        }
    }

    /// Records how long an operation waited, from the first poll that found it incomplete to
    /// its completion.
    pub(crate) fn observe(&self, send: bool, took: Duration) {
        // Samples far above the cap count as just above it: one long wait must not take many
        // fast operations to forget, and one operation that waited briefly after long waits
        // brings spinning back.
        let sample = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX).min(self.cap_ns.saturating_mul(2));
        let a = self.avg(send);
        let old = a.load(Ordering::Relaxed);
        a.store(old - old / 8 + sample / 8, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_operations_spin_and_slow_ones_sleep() {
        let s = Spin::new(Duration::from_micros(100));
        assert_eq!(s.budget(true), Duration::from_micros(75), "starts at half the cap, times 1.5");
        for _ in 0..64 {
            s.observe(true, Duration::from_micros(10));
        }
        let b = s.budget(true);
        assert!(b >= Duration::from_micros(14) && b <= Duration::from_micros(17), "{b:?}");
        for _ in 0..64 {
            s.observe(false, Duration::from_secs(5));
        }
        assert_eq!(s.budget(false), Duration::ZERO, "receives that wait long stop spinning");
        assert!(s.budget(true) > Duration::ZERO, "the queues adapt separately");
        for _ in 0..16 {
            s.observe(false, Duration::from_micros(5));
        }
        assert!(s.budget(false) > Duration::ZERO, "fast receives bring spinning back");
        assert_eq!(Spin::new(Duration::ZERO).budget(true), Duration::ZERO, "a zero cap never spins");
        let b = s.budget(true);
        s.expire(true);
        assert_eq!(s.budget(true), Duration::ZERO, "after a spin ran out, others sleep at once");
        assert!(s.budget(false) > Duration::ZERO, "per queue");
        s.claimed(true);
        assert_eq!(s.budget(true), b, "a claimed completion brings spinning back");
        assert_eq!(Spin::new(Duration::MAX).budget(true), MAX_SPIN * 3 / 4, "the cap is clamped to MAX_SPIN");
    }
}
