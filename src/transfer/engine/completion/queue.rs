//! A connection's per-queue bookkeeping: tickets, the outcomes reaped for them, the buffers
//! parked on them, the send queue's slots.

use std::collections::VecDeque;

use crate::transfer::engine::completion::{Failure, Outcome};
use crate::transfer::engine::stats::QueueCounts;
use crate::verbs::WorkCompletion;

/// A posted request's claim on its outcome: its work request and the queue it is on. Posting
/// returns one; every way of waiting takes one — busy polling, sleeping on the completion
/// channel or for a poller thread ([`crate::transfer::Connection`]'s blocking wait), or a
/// future (the async front end) — and an abandoned one parks its buffer here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    pub(crate) wr_id: u64,
    pub(crate) send: bool,
}

impl Ticket {
    pub(crate) fn send(wr_id: u64) -> Ticket {
        Ticket { wr_id, send: true }
    }

    pub(crate) fn recv(wr_id: u64) -> Ticket {
        Ticket { wr_id, send: false }
    }
}

/// A buffer owned by an operation nobody waits for.
pub(crate) type Parked = Box<dyn Send>;

/// A ticket's life, from its post to the claim of its outcome or the release of its buffer:
/// the one record of a request in flight (tokio-uring's `Lifecycle`, for work requests).
pub(super) enum Lifecycle {
    /// Posted, its completion not reaped yet. `retires`: the send-queue slots its completion
    /// retires (a chain's tail retires the chain); `op`: its operation's name.
    Submitted { retires: u32, op: &'static str },
    /// Posted, and nobody waits for it any more: `buf` is released when its completion (or
    /// flush) is reaped.
    Abandoned { retires: u32, op: &'static str, buf: Parked },
    /// Reaped: the outcome waits for its waiter to claim it.
    Completed(Outcome),
}

/// A queue's tickets by work-request id, in posting order: a queue completes its requests in
/// that order, so the one a completion names is at the front, or near it (lookups scan from
/// there; removals keep the order).
#[derive(Default)]
pub(super) struct Tickets {
    by_id: VecDeque<(u64, Lifecycle)>,
    /// How many are `Abandoned` (so "anything parked?" costs nothing).
    abandoned: usize,
}

impl Tickets {
    /// A request posted as `id` (signaled: its completion will be reaped). Ids grow with every
    /// post, so this keeps the order.
    pub(super) fn submitted(&mut self, id: u64, retires: u32, op: &'static str) {
        self.by_id.push_back((id, Lifecycle::Submitted { retires, op }));
    }

    /// Where `id` is in the table: at the front, almost always (completions come in order).
    #[inline(always)]
    pub(super) fn find(&self, id: u64) -> Option<usize> {
        match self.by_id.front() {
            Some((k, _)) if *k == id => Some(0),
            _ => self.find_further(id),
        }
    }

    /// [`Tickets::find`] past the front.
    #[inline(never)]
    fn find_further(&self, id: u64) -> Option<usize> {
        self.by_id.iter().position(|(k, _)| *k == id)
    }

    /// The ticket at `i` ([`Tickets::find`]).
    #[inline]
    pub(super) fn at(&self, i: usize) -> &Lifecycle {
        &self.by_id[i].1
    }

    /// The ticket at `i` completed with `o` (it was `Submitted`).
    #[inline]
    pub(super) fn complete(&mut self, i: usize, o: Outcome) {
        debug_assert!(matches!(self.by_id[i].1, Lifecycle::Submitted { .. }));
        self.by_id[i].1 = Lifecycle::Completed(o);
    }

    /// Nobody waits for the `Submitted` ticket at `i` any more: `buf` stays until its
    /// completion is reaped.
    pub(super) fn abandon(&mut self, i: usize, buf: Parked) {
        let Lifecycle::Submitted { retires, op } = self.by_id[i].1 else {
            unreachable!("only a submitted ticket is abandoned")
        };
        self.by_id[i].1 = Lifecycle::Abandoned { retires, op, buf };
        self.abandoned += 1;
    }

    /// Takes the ticket at `i` out of the table.
    #[inline]
    pub(super) fn remove_at(&mut self, i: usize) -> Lifecycle {
        let taken = if i == 0 { self.by_id.pop_front() } else { self.by_id.remove(i) };
        let (_, l) = taken.expect("an index found in the table");
        if matches!(l, Lifecycle::Abandoned { .. }) {
            self.abandoned -= 1;
        }
        l
    }

    /// Takes `id`'s outcome if it has completed (else leaves it be).
    #[inline(always)]
    pub(super) fn claim(&mut self, id: u64) -> Option<Outcome> {
        // The common cases touch only the front: the ticket waited for is the oldest.
        match self.by_id.front() {
            Some((k, Lifecycle::Completed(_))) if *k == id => match self.by_id.pop_front() {
                Some((_, Lifecycle::Completed(o))) => Some(o),
                _ => None,
            },
            Some((k, _)) if *k == id => None,
            _ => self.claim_further(id),
        }
    }

    /// [`Tickets::claim`] of a ticket past the front.
    #[inline(never)]
    fn claim_further(&mut self, id: u64) -> Option<Outcome> {
        let i = self.find(id)?;
        if !matches!(self.by_id[i].1, Lifecycle::Completed(_)) {
            return None;
        }
        match self.remove_at(i) {
            Lifecycle::Completed(o) => Some(o),
            _ => None,
        }
    }

    /// Whether `id` has completed, its outcome not claimed yet.
    pub(super) fn is_completed(&self, id: u64) -> bool {
        self.find(id).is_some_and(|i| matches!(self.by_id[i].1, Lifecycle::Completed(_)))
    }

    /// Whether `id` is posted and not reaped yet.
    pub(super) fn in_flight(&self, id: u64) -> bool {
        self.find(id).is_some_and(|i| !matches!(self.by_id[i].1, Lifecycle::Completed(_)))
    }

    /// Whether any buffer waits for its completion.
    #[inline]
    pub(super) fn any_abandoned(&self) -> bool {
        self.abandoned > 0
    }

    /// Takes every abandoned ticket's buffer (the connection is done with the queue pair).
    pub(super) fn take_abandoned(&mut self) -> Vec<Parked> {
        let mut bufs = Vec::new();
        let mut kept = VecDeque::with_capacity(self.by_id.len());
        for (id, l) in self.by_id.drain(..) {
            match l {
                Lifecycle::Abandoned { buf, .. } => bufs.push(buf),
                l => kept.push_back((id, l)),
            }
        }
        self.by_id = kept;
        self.abandoned = 0;
        bufs
    }
}

/// What a queue (send or receive) keeps about its requests.
pub(super) struct Queue {
    /// Every signaled request from its post until its outcome is claimed or its buffer
    /// released.
    pub(super) tickets: Tickets,
    /// Parked buffers whose completion was reaped: dropped once the lock is released.
    pub(super) released: Vec<Parked>,
    /// A flush reaped that no waiter will explain (see the module docs): recorded once the
    /// lock is released.
    pub(super) orphan: Option<Failure>,
    /// Slots in use (posted, not yet retired by a completion).
    pub(super) used: u32,
    /// Reused poll buffer.
    pub(super) wcs: [WorkCompletion; 8],
    /// What this queue posted and reaped (for `Connection::stats`).
    pub(super) counts: QueueCounts,
}

impl Default for Queue {
    fn default() -> Queue {
        Queue {
            tickets: Tickets::default(),
            released: Vec::new(),
            orphan: None,
            used: 0,
            wcs: std::array::from_fn(|_| WorkCompletion::empty()),
            counts: QueueCounts::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::Completed;
    use crate::verbs::WcOpcode;

    fn done(n: u32) -> Outcome {
        Ok(Completed { byte_len: n, imm: None, opcode: WcOpcode::RdmaWrite })
    }

    /// Marks ticket `id` completed, as a reap does.
    fn reap(t: &mut Tickets, id: u64) -> bool {
        let Some(i) = t.find(id) else { return false };
        match t.at(i) {
            Lifecycle::Submitted { .. } => {
                t.complete(i, done(id as u32));
                true
            }
            Lifecycle::Abandoned { .. } => {
                assert!(matches!(t.remove_at(i), Lifecycle::Abandoned { .. }));
                false
            }
            Lifecycle::Completed(_) => false,
        }
    }

    #[test]
    fn tickets_are_claimed_in_and_out_of_order_and_nothing_is_lost() {
        let mut t = Tickets::default();
        // Many posted (a queue that never drains: receives kept posted), claimed in order,
        // with new ones posted meanwhile.
        let mut next = 1u64;
        for _ in 0..256 {
            t.submitted(next, 1, "recv");
            next += 1;
        }
        let mut oldest = 1u64;
        for _ in 0..10_000 {
            assert_eq!(t.claim(oldest), None, "not completed yet");
            assert!(t.in_flight(oldest) && !t.is_completed(oldest));
            assert!(reap(&mut t, oldest));
            assert!(t.is_completed(oldest) && !t.in_flight(oldest));
            assert_eq!(t.claim(oldest).unwrap().unwrap().byte_len, oldest as u32);
            assert_eq!(t.claim(oldest), None, "claimed once");
            oldest += 1;
            t.submitted(next, 1, "recv");
            next += 1;
            assert_eq!(t.by_id.len(), 256);
        }
        // Out of order: complete three, claim the middle one first.
        let (a, b, c) = (oldest, oldest + 1, oldest + 2);
        for id in [a, b, c] {
            assert!(reap(&mut t, id));
        }
        assert!(t.claim(b).is_some() && t.claim(b).is_none());
        assert!(t.claim(c).is_some() && t.claim(a).is_some());
        assert!(t.find(a).is_none() && t.find(b).is_none() && t.find(c).is_none());
        assert_eq!(t.find(c + 1), Some(0));
    }

    #[test]
    fn abandoned_tickets_keep_their_buffers_until_reaped_or_taken() {
        let mut t = Tickets::default();
        for id in 1..=4 {
            t.submitted(id, 2, "RDMA WRITE");
        }
        let i = t.find(2).unwrap();
        t.abandon(i, Box::new(vec![2u8]));
        let i = t.find(4).unwrap();
        t.abandon(i, Box::new(vec![4u8]));
        assert!(t.any_abandoned());
        assert!(t.in_flight(2) && !t.is_completed(2));
        // Reaped: an abandoned ticket leaves the table (its buffer is released by the caller).
        assert!(reap(&mut t, 1) && !reap(&mut t, 2));
        assert!(t.find(2).is_none() && t.any_abandoned());
        // The connection takes back what is still held; completed outcomes stay for waiters.
        let held = t.take_abandoned();
        assert_eq!(held.len(), 1);
        assert!(!t.any_abandoned());
        assert!(t.find(4).is_none() && t.is_completed(1) && t.in_flight(3));
        assert!(t.claim(1).is_some());
        assert_eq!(t.find(3), Some(0));
    }
}
