//! Waiting for a striped transfer, and the one rule for a slice that takes too long.
//!
//! A blocking wait never sleeps on one rail for longer than [`NAP`] while the others may
//! progress: a rail that dies without a word (a path that black-holes) holds up only its own
//! slices, until its oldest slice of the transfer has waited its connection's `op_timeout`;
//! then the rail is failed, its slices flushed and posted again on the rails that live.

use std::time::{Duration, Instant};

use crate::error::Error;
use crate::transfer::connection::FLUSH_WAIT;
use crate::transfer::engine::completion::Failure;
use crate::transfer::rails::finished::Finished;
use crate::transfer::rails::transfer::Striped;
use crate::verbs::WcStatus;

/// How long a blocking wait sleeps on one rail's completions before it looks at the others.
const NAP: Duration = Duration::from_millis(1);

impl<B: Send + 'static> Striped<B> {
    /// Waits until every slice has completed (or failed for good) and gives the buffers back
    /// with an outcome per piece and a report per rail. A rail that fails meanwhile has its
    /// slices posted again on the others; a piece fails if its own request failed (a refused
    /// key or range: [`Error::Operation`]) or every rail that reaches it failed
    /// ([`Error::RailsDown`]). A rail whose slice waits longer than its connection's
    /// [`op_timeout`](crate::transfer::WaitOptions::op_timeout) is failed (its slices go to
    /// the others). Waiting spins for the connection's `wait.spin`, then sleeps on the
    /// completions of the rail with the oldest slice, at most a millisecond at a time.
    pub fn wait(mut self) -> Finished<B> {
        let mut quiet_since: Option<Instant> = None;
        loop {
            if self.forked() {
                break;
            }
            let moved = self.reap_ready();
            let next = self.expire_stalled();
            self.post_more();
            if self.is_over() {
                break;
            }
            if moved {
                quiet_since = None;
                continue;
            }
            // A failed rail's oldest slice: its flush comes at once — or never, which only the
            // connection's own wait tells (FlushLost): wait there.
            let failed = (0..self.flights.len())
                .find(|&r| !self.flights[r].is_empty() && self.rails.rails()[r].conn().core().failure().is_some());
            if let Some(r) = failed {
                let ticket = self.flights[r].front().expect("a slice in flight").ticket;
                let res = self.rails.rails()[r].conn().wait(ticket);
                self.settle(r, res);
                continue;
            }
            let oldest = (0..self.flights.len()).filter_map(|r| self.flights[r].front().map(|f| (f.seq, r))).min();
            let Some((_, r)) = oldest else {
                // Send queues full of other transfers' requests: their completions make room,
                // once reaped (posting does not reap).
                for rail in self.rails.rails() {
                    let _ = rail.conn().progress();
                }
                std::thread::yield_now();
                continue;
            };
            let conn = self.rails.rails()[r].conn();
            if quiet_since.get_or_insert_with(Instant::now).elapsed() < conn.options().wait.spin {
                std::hint::spin_loop();
                continue;
            }
            let left = next.map_or(NAP, |d| d.saturating_duration_since(Instant::now()));
            conn.nap(left.min(NAP));
        }
        self.finish()
    }

    /// Fails each live rail whose oldest slice of this transfer has waited longer than its
    /// connection's `op_timeout` (the slices are flushed, then posted again elsewhere), and
    /// gives up on the slices of a failed rail whose flush has not come `FLUSH_WAIT` after
    /// that: their memory is leaked with the transfer's buffers (the NIC may still use it).
    /// Returns the earliest deadline of the slices left.
    pub(crate) fn expire_stalled(&mut self) -> Option<Instant> {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        for r in 0..self.flights.len() {
            let Some(f) = self.flights[r].front() else { continue };
            let conn = self.rails.rails()[r].conn();
            // A timeout too far to add is no timeout.
            let Some(deadline) = f.posted.checked_add(conn.options().wait.op_timeout) else { continue };
            let lost_at = deadline.checked_add(FLUSH_WAIT).unwrap_or(deadline);
            match conn.core().failure() {
                None if now >= deadline => {
                    tracing::debug!("rails: a slice on rail {r} waited {:?}; failing the rail", now - f.posted);
                    let op = if self.read { "RDMA READ (a striped slice)" } else { "RDMA WRITE (a striped slice)" };
                    conn.fail(Failure::Op {
                        op,
                        wr_id: f.ticket.wr_id,
                        status: WcStatus::RespTimeoutErr,
                        vendor_err: 0,
                    });
                }
                None => next = Some(next.map_or(deadline, |n| n.min(deadline))),
                Some(_) if now >= lost_at => {
                    tracing::error!("rails: rail {r} was never flushed; leaking the transfer's buffers");
                    self.leak = true;
                    let waited = now - f.posted;
                    for f in std::mem::take(&mut self.flights[r]) {
                        // Its bytes stay on the rail's load: the rail is dead.
                        self.pieces[f.cut.piece]
                            .error
                            .get_or_insert(Error::FlushLost { wr_id: f.ticket.wr_id, waited });
                    }
                }
                Some(_) => next = Some(next.map_or(lost_at, |n| n.min(lost_at))),
            }
        }
        next
    }
}
