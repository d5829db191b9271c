//! Reaping a CQ: each work completion retires its send-queue slots, becomes its ticket's
//! outcome (or releases the buffer parked on it), and a flush nobody waits for is kept to be
//! explained.

use std::sync::atomic::Ordering;

use crate::error::Result;
use crate::transfer::engine::completion::queue::{Lifecycle, Queue};
use crate::transfer::engine::completion::{Core, Mode, Outcome, PROBE_OP};
use crate::verbs::{WcOpcode, WcStatus};

impl Core {
    /// Polls a queue's CQ once: each completion retires its slots and becomes its ticket's
    /// outcome. Returns how many it reaped.
    #[inline]
    pub(super) fn reap(&self, send: bool, q: &mut Queue) -> Result<usize> {
        self.reap_for(send, q, None).map(|(n, _)| n)
    }

    /// [`Core::reap`] by `want`'s waiter: `want`'s own outcome, if reaped, comes straight back
    /// (its ticket leaves the table) instead of waiting in the table to be claimed.
    #[inline]
    pub(super) fn reap_claiming(&self, send: bool, q: &mut Queue, want: u64) -> Result<Option<Outcome>> {
        self.reap_for(send, q, Some(want)).map(|(_, mine)| mine)
    }

    #[inline(always)]
    fn reap_for(&self, send: bool, q: &mut Queue, want: Option<u64>) -> Result<(usize, Option<Outcome>)> {
        #[cfg(test)]
        {
            use std::sync::atomic::Ordering::Relaxed;
            if self.fail_polls.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)).is_ok() {
                return Err(crate::error::Error::verbs_errno("ibv_poll_cq", libc::EIO));
            }
        }
        let cq = if send { &self.send_cq } else { &self.recv_cq };
        let n = cq.poll(&mut q.wcs)?;
        let mut mine = None;
        if n > 0 && self.mode == Mode::Event {
            // Under the queue's lock, before anything reaped can be claimed. Only event-mode
            // waits read it: other modes keep the atomic off their hot path.
            self.reaps.fetch_add(1, Ordering::SeqCst);
            // Waiters napping while another sleeps on the channel: this may be theirs.
            if self.nappers.load(Ordering::SeqCst) > 0 {
                let _g = self.wake_lock.lock();
                self.wake.notify_all();
            }
        }
        for i in 0..n {
            let id = q.wcs[i].wr_id();
            let at = q.tickets.find(id);
            let (retired, op) = match at.map(|t| q.tickets.at(t)) {
                Some(Lifecycle::Submitted { retires, op } | Lifecycle::Abandoned { retires, op, .. }) => {
                    (*retires, *op)
                }
                // Receives retire one slot each.
                _ if !send => (1, "recv"),
                // An id that is no signaled request's completes only when flushed: its slot is
                // retired by its chain's tail.
                _ => (0, "send-queue request"),
            };
            q.used = q.used.saturating_sub(retired);
            let o = self.outcome(&q.wcs[i], op);
            let flushed = q.wcs[i].status() == WcStatus::WrFlushErr;
            if op == PROBE_OP {
                // A keepalive probe is no request of the application's, and nobody waits for it;
                // its failure is the connection's (its flush only if nothing explains it).
                if let Some(t) = at {
                    q.tickets.remove_at(t);
                }
                if flushed {
                    q.orphan = q.orphan.or(o.err());
                } else if o.is_err() {
                    q.counts.errors += 1;
                }
                continue;
            }
            match &o {
                Ok(c) => {
                    q.counts.completions += 1;
                    // A WRITE with immediate's byte_len counts bytes that went elsewhere.
                    if !send && c.opcode == WcOpcode::Recv {
                        q.counts.bytes += u64::from(c.byte_len);
                    }
                }
                Err(_) => q.counts.errors += 1,
            }
            let waited = match at.map(|t| (t, q.tickets.at(t))) {
                Some((t, Lifecycle::Submitted { .. })) if want == Some(id) => {
                    q.tickets.remove_at(t);
                    mine = Some(o);
                    true
                }
                Some((t, Lifecycle::Submitted { .. })) => {
                    q.tickets.complete(t, o);
                    true
                }
                Some((t, Lifecycle::Abandoned { .. })) => {
                    if let Lifecycle::Abandoned { buf, .. } = q.tickets.remove_at(t) {
                        q.released.push(buf);
                    }
                    false
                }
                // Not signaled (flushed), or a second completion for one id (a device fault):
                // nobody waits for it.
                Some((_, Lifecycle::Completed(_))) | None => false,
            };
            if flushed && !waited {
                q.orphan = q.orphan.or(o.err());
            }
        }
        Ok((n, mine))
    }

    /// Reaps a queue's CQ until it is empty, bounded by its capacity (what arrives later is
    /// another round's).
    pub(super) fn drain_queue(&self, send: bool, q: &mut Queue) -> Result<usize> {
        let cap = if send { self.send_cq.depth() } else { self.recv_cq.depth() } as usize;
        let mut total = 0;
        while total <= cap {
            let n = self.reap(send, q)?;
            if n == 0 {
                break;
            }
            total += n;
        }
        Ok(total)
    }
}
