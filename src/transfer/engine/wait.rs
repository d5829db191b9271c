//! Waiting for a posted request's completion: the one loop every blocking wait runs (a
//! request of the blocking API, a `Pending`, a batch's chunk, a flush marker), whatever the
//! connection's [`WaitMode`](crate::transfer::WaitMode) — and what it does when the wait itself goes wrong.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::transfer::connection::FLUSH_WAIT;
use crate::transfer::engine::completion::{Completed, Failure, Outcome, Ticket};
use crate::transfer::Connection;
use crate::verbs::WcStatus;

impl Connection {
    /// Waits for `ticket`'s completion, the way the connection's
    /// [`WaitMode`](crate::transfer::WaitMode) says (busy
    /// polling, the completion channel, the poller thread). Whatever goes wrong (the operation timeout, a failing
    /// `ibv_poll_cq` or completion-channel call) fails the connection and *keeps waiting* for the
    /// request's flush, so that when this returns the NIC no longer uses the request's memory —
    /// except with [`Error::FlushLost`], when the flush never came: then the caller must leak
    /// the memory (owned) or abort (borrowed).
    pub(crate) fn wait(&self, ticket: Ticket) -> Result<Completed> {
        self.usable()?;
        // The common case, a completion already there: claimed without setting up the loop
        // (the loop's first round, exactly).
        #[cfg(test)]
        if self.core().panic_in_wait.swap(false, std::sync::atomic::Ordering::Relaxed) {
            panic!("injected panic while work request {} is in flight", ticket.wr_id);
        }
        match self.core().try_claim(ticket) {
            Ok(Some(o)) => {
                self.core().spin_claimed(ticket.send, None);
                self.settle(o, None)
            }
            Ok(None) => self.wait_loop(ticket, None),
            Err(e) => self.wait_loop(ticket, Some(e)),
        }
    }

    /// [`Connection::wait`] once the first look found nothing (or failed with `first`, which
    /// fails the connection as a failure found in the loop does).
    #[inline(never)]
    fn wait_loop(&self, ticket: Ticket, first: Option<Error>) -> Result<Completed> {
        let Ticket { wr_id, send } = ticket;
        // Send-queue requests are answered by the peer's NIC; receives wait for its application.
        let limit = if send { Some(self.options().wait.op_timeout) } else { self.options().wait.recv_timeout };
        // Started by the first poll that finds nothing: a completion claimed at once costs no
        // clock read. Loops that sleep read the clock on every round.
        let mut watch = self.core().stopwatch();
        // The local failure (timeout, verbs error) that made this wait fail the connection, and
        // when (on the watch).
        let mut local: Option<(Error, Duration)> = None;
        // When this wait, which has no deadline, saw the connection failed by someone else.
        let mut orphaned: Option<Duration> = None;
        let mut spins = 0u32;
        // Event mode: polls without sleeping until this much after the first miss (decided
        // then), so a fast operation never pays a channel event.
        let mut spin: Option<Duration> = None;
        if let Some(e) = first {
            let now = watch.elapsed();
            self.fail_locally(&mut local, e, now);
        }
        loop {
            let mark = self.core().mark();
            let claimed = self.core().try_claim(ticket);
            if let Ok(Some(o)) = claimed {
                self.core().spin_claimed(send, Some(&watch));
                return self.settle(o, local.map(|(e, _)| e));
            }
            let now = watch.elapsed();
            if let Err(e) = claimed {
                self.fail_locally(&mut local, e, now);
            }
            if orphaned.is_none() && local.is_none() && limit.is_none() && self.core().failure().is_some() {
                // No deadline of its own: a failure recorded elsewhere (the watcher, another
                // waiter) must flush this request within FLUSH_WAIT, or its memory is lost.
                orphaned = Some(now);
            }
            if let Some(limit) = limit.filter(|&l| local.is_none() && now > l) {
                let what = if send { "waiting for a send completion" } else { "waiting for a receive" };
                self.fail(Failure::Op { op: what, wr_id, status: WcStatus::RespTimeoutErr, vendor_err: 0 });
                local = Some((Error::Timeout(limit, "a completion"), now));
            }
            let left = match local.as_ref().map(|(_, since)| *since).or(orphaned) {
                Some(since) => {
                    let waited = now.saturating_sub(since);
                    if waited > FLUSH_WAIT {
                        return Err(Error::FlushLost { wr_id, waited });
                    }
                    FLUSH_WAIT - waited
                }
                // Without a limit, sleep in slices (a failure flushes the request and wakes it).
                None => limit.map_or(Duration::from_secs(1), |l| l.saturating_sub(now)),
            };
            let budget = *spin.get_or_insert_with(|| self.core().spin_budget(send));
            if local.is_none() && orphaned.is_none() && now < budget {
                std::hint::spin_loop();
                continue;
            }
            if budget > Duration::ZERO {
                self.core().spin_expired(send);
                spin = Some(Duration::ZERO);
            }
            if let Err(e) = self.core().pause(&mut spins, left.max(Duration::from_millis(1)), mark) {
                self.fail_locally(&mut local, e, now);
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Waits at most `max` for a completion on this connection, the way its mode waits, without
    /// claiming any and without failing the connection if none comes (a rails transfer's
    /// wait, which watches several connections, sleeps on one at a time).
    pub(crate) fn nap(&self, max: Duration) {
        let mark = self.core().mark();
        if matches!(self.progress(), Ok(n) if n > 0) {
            return;
        }
        let mut spins = 0;
        if let Err(e) = self.core().pause(&mut spins, max, mark) {
            tracing::debug!("completion path failed ({e}); failing the connection");
            self.fail(Failure::local(&e));
        }
    }

    /// Records a local error of the completion path: fails the connection, starts the flush wait
    /// (`now`, on the waiter's watch).
    fn fail_locally(&self, local: &mut Option<(Error, Duration)>, e: Error, now: Duration) {
        if local.is_none() {
            tracing::debug!("completion path failed ({e}); failing the connection and waiting for the flush");
            self.fail(Failure::local(&e));
            *local = Some((e, now));
        }
    }

    fn settle(&self, o: Outcome, local: Option<Error>) -> Result<Completed> {
        match (o, local) {
            (_, Some(e)) => Err(e),
            (Ok(c), None) => Ok(c),
            (Err(f), None) => Err(self.core().cause(f).error()),
        }
    }
}
