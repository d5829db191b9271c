//! How a blocking wait spins and sleeps on a connection: the adaptive spin of event mode
//! (`spin.rs`), sleeping on the completion channel, napping while another thread sleeps there,
//! or waiting for a poller thread.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::clock::Stopwatch;
use crate::error::Result;
use crate::transfer::engine::completion::{Core, Mode};

impl Core {
    /// How long a blocking wait that found its request incomplete polls before it sleeps
    /// (event mode's adaptive spin, see `spin.rs`; zero in the other modes).
    pub(crate) fn spin_budget(&self, send: bool) -> Duration {
        self.spin.budget(send)
    }

    /// A blocking wait's spin ran out without its completion (`spin.rs`).
    pub(crate) fn spin_expired(&self, send: bool) {
        self.spin.expire(send);
    }

    /// A blocking wait claimed its completion; `watch` started at its first miss (`None`, or
    /// not started: claimed at its first poll).
    #[inline]
    pub(crate) fn spin_claimed(&self, send: bool, watch: Option<&Stopwatch>) {
        if self.mode != Mode::Event {
            return;
        }
        if let Some(waited) = watch.and_then(Stopwatch::exact) {
            self.spin.observe(send, waited);
        }
        self.spin.claimed(send);
    }

    /// Waits a little for progress, the way the connection's mode says: spin, sleep on the
    /// completion channel, or sleep until the poller thread signals. `mark` ([`Core::mark`])
    /// was taken before the caller last looked for its outcome.
    pub(crate) fn pause(&self, spins: &mut u32, max: Duration, mark: u64) -> Result<()> {
        match self.mode {
            Mode::BusyPoll => {
                *spins = spins.wrapping_add(1);
                if *spins % 256 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            Mode::Event => {
                let Some(ch) = &self.channel else { return Ok(()) };
                // One thread sleeps on the channel at a time; the others nap until a reap (the
                // sleeper's, once an event wakes it: it reaps both queues before sleeping
                // again) may have brought theirs, at most 100 ms.
                let Some(_g) = self.event_lock.try_lock() else {
                    let mut g = self.wake_lock.lock();
                    // Announced before the mark is read, and a reap bumps the mark before it
                    // reads the count (all SeqCst): either this nap sees the new mark, or that
                    // reap sees the napper and notifies under the lock this nap waits with.
                    self.nappers.fetch_add(1, Ordering::SeqCst);
                    if self.mark() == mark {
                        self.wake.wait_for(&mut g, max.min(Duration::from_millis(100)));
                    }
                    self.nappers.fetch_sub(1, Ordering::SeqCst);
                    return Ok(());
                };
                self.send_cq.arm()?;
                self.recv_cq.arm()?;
                // Completions that arrived before arming raise no event: collect them now. One
                // another thread reaped since the caller last looked raised none either (nor
                // will it): no sleep.
                if self.progress()? == 0 && self.mark() == mark {
                    ch.wait(max.min(Duration::from_millis(100)))?;
                }
            }
            Mode::Poller => {
                let mut g = self.wake_lock.lock();
                // Bounded: a wake-up that raced this wait costs at most a millisecond.
                self.wake.wait_for(&mut g, max.min(Duration::from_millis(1)));
            }
        }
        Ok(())
    }
}
