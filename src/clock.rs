//! [`Stopwatch`]: elapsed time for poll loops, without a clock read on every poll.
//!
//! Reading the clock is cheap where the vDSO can read it (about 20 ns), but it is a system call
//! where it cannot (virtual machines whose clocksource is not the TSC, such as the Soft-RoCE
//! VM), and there it cost more than the completion the loop waits for. A wait that is claimed
//! on its first poll therefore reads no clock at all, and a busy-polling loop reads it once
//! every [`EVERY`] polls. The limits these loops enforce are milliseconds to seconds long, far
//! beyond what a few dozen polls take.

use std::time::{Duration, Instant};

/// A busy-polling loop reads the clock once in this many calls.
pub(crate) const EVERY: u32 = 32;

/// Time since the first [`Stopwatch::elapsed`] call.
#[derive(Debug, Default)]
pub(crate) struct Stopwatch {
    start: Option<Instant>,
    calls: u32,
    last: Duration,
}

impl Stopwatch {
    pub(crate) fn new() -> Stopwatch {
        Stopwatch::default()
    }

    /// The time since the first call (zero on the first call, which starts the watch). The clock
    /// is read only on every [`EVERY`]th call, or on every call with `exact` (loops whose polls
    /// sleep, where a stale value could be a whole sleep late); other calls return the last
    /// value read.
    pub(crate) fn elapsed(&mut self, exact: bool) -> Duration {
        let Some(start) = self.start else {
            self.start = Some(Instant::now());
            return Duration::ZERO;
        };
        self.calls = self.calls.wrapping_add(1);
        if exact || self.calls % EVERY == 0 {
            self.last = start.elapsed();
        }
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_clock_lazily() {
        let mut w = Stopwatch::new();
        assert_eq!(w.elapsed(false), Duration::ZERO, "the first call starts the watch");
        std::thread::sleep(Duration::from_millis(5));
        // Calls 1..EVERY-1 return the cached value; the EVERY-th reads the clock.
        for _ in 1..EVERY {
            assert_eq!(w.elapsed(false), Duration::ZERO);
        }
        assert!(w.elapsed(false) >= Duration::from_millis(5), "every EVERY-th call reads the clock");
        std::thread::sleep(Duration::from_millis(5));
        assert!(w.elapsed(true) >= Duration::from_millis(10), "an exact call always reads it");
    }
}
