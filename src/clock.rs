//! [`Stopwatch`]: elapsed time for poll loops, without a clock read on every poll.
//!
//! Reading the clock is cheap where the vDSO can read it (about 20 ns), but it is a system call
//! where it cannot (virtual machines whose clocksource is not the TSC, such as the Soft-RoCE
//! VM), and there it cost more than the completion the loop waits for. A wait that is claimed
//! on its first poll therefore reads no clock at all, and a busy-polling loop reads it only once
//! in a number of polls ([`BUSY`] for the blocking waits). The limits these loops enforce are
//! microseconds to seconds long, beyond what a few polls take.

use std::time::{Duration, Instant};

/// Blocking busy-poll loops read the clock once in this many calls.
pub(crate) const BUSY: u32 = 32;

/// Time since the first [`Stopwatch::elapsed`] call.
#[derive(Debug)]
pub(crate) struct Stopwatch {
    start: Option<Instant>,
    calls: u32,
    every: u32,
    last: Duration,
}

impl Stopwatch {
    /// A watch that reads the clock once in `every` calls to [`Stopwatch::elapsed`] (1: on every
    /// call, for loops whose polls sleep, where a stale value could be a whole sleep late).
    pub(crate) fn new(every: u32) -> Stopwatch {
        Stopwatch { start: None, calls: 0, every: every.max(1), last: Duration::ZERO }
    }

    /// The time since the first call (zero on the first call, which starts the watch). The clock
    /// is read only on every `every`th call; other calls return the last value read.
    pub(crate) fn elapsed(&mut self) -> Duration {
        let Some(start) = self.start else {
            self.start = Some(Instant::now());
            return Duration::ZERO;
        };
        self.calls = self.calls.wrapping_add(1);
        if self.calls % self.every == 0 {
            self.last = start.elapsed();
        }
        self.last
    }

    /// The time since the watch started, read from the clock now; `None` if it never started.
    pub(crate) fn exact(&self) -> Option<Duration> {
        self.start.map(|s| s.elapsed())
    }

    /// Whether the watch started (an earlier call to [`Stopwatch::elapsed`]).
    #[cfg(any(test, feature = "tokio"))]
    pub(crate) fn started(&self) -> bool {
        self.start.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_clock_lazily() {
        let mut w = Stopwatch::new(BUSY);
        assert!(!w.started() && w.exact().is_none());
        assert_eq!(w.elapsed(), Duration::ZERO, "the first call starts the watch");
        assert!(w.started());
        std::thread::sleep(Duration::from_millis(5));
        // Calls 1..BUSY-1 return the cached value; the BUSY-th reads the clock.
        for _ in 1..BUSY {
            assert_eq!(w.elapsed(), Duration::ZERO);
        }
        assert!(w.elapsed() >= Duration::from_millis(5), "every BUSY-th call reads the clock");
        std::thread::sleep(Duration::from_millis(5));
        assert!(w.exact().unwrap() >= Duration::from_millis(10), "an exact read always reads it");
        let mut every = Stopwatch::new(1);
        every.elapsed();
        std::thread::sleep(Duration::from_millis(2));
        assert!(every.elapsed() >= Duration::from_millis(2), "a period of 1 reads on every call");
    }
}
