//! A connection's per-queue bookkeeping: tickets, the outcomes reaped for them, the buffers
//! parked on them, the send queue's slots.

use crate::transfer::completion::{Failure, Outcome};
use crate::transfer::stats::QueueCounts;
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

/// A queue's tickets by work-request id. Completions are claimed quickly and chains signal only
/// their tail, so this stays small and a linear scan beats hashing on the hot path.
pub(super) struct Tickets(Vec<(u64, Lifecycle)>);

impl Default for Tickets {
    fn default() -> Tickets {
        Tickets(Vec::with_capacity(8))
    }
}

impl Tickets {
    /// A request posted as `id` (signaled: its completion will be reaped).
    pub(super) fn submitted(&mut self, id: u64, retires: u32, op: &'static str) {
        self.0.push((id, Lifecycle::Submitted { retires, op }));
    }

    /// Keeps `buf` of a request the table does not track until the connection takes back
    /// everything it holds ([`Tickets::take_abandoned`]).
    pub(super) fn keep(&mut self, id: u64, buf: Parked) {
        self.0.push((id, Lifecycle::Abandoned { retires: 0, op: "abandoned request", buf }));
    }

    /// Where `id` is in the table.
    #[inline]
    pub(super) fn find(&self, id: u64) -> Option<usize> {
        self.0.iter().position(|(k, _)| *k == id)
    }

    /// The ticket at `i` ([`Tickets::find`]).
    #[inline]
    pub(super) fn at(&mut self, i: usize) -> &mut Lifecycle {
        &mut self.0[i].1
    }

    /// The ticket `id`, if it is in the table.
    #[inline]
    pub(super) fn get_mut(&mut self, id: u64) -> Option<&mut Lifecycle> {
        let i = self.find(id)?;
        Some(self.at(i))
    }

    /// Takes the ticket at `i` out of the table.
    #[inline]
    pub(super) fn remove_at(&mut self, i: usize) -> Lifecycle {
        self.0.swap_remove(i).1
    }

    /// Takes `id` out of the table.
    pub(super) fn remove(&mut self, id: u64) -> Option<Lifecycle> {
        let i = self.find(id)?;
        Some(self.remove_at(i))
    }

    /// Takes `id`'s outcome if it has completed (else leaves it be).
    #[inline]
    pub(super) fn claim(&mut self, id: u64) -> Option<Outcome> {
        let i = self.find(id)?;
        if !matches!(self.0[i].1, Lifecycle::Completed(_)) {
            return None;
        }
        match self.remove_at(i) {
            Lifecycle::Completed(o) => Some(o),
            _ => None,
        }
    }

    /// Whether `id` has completed, its outcome not claimed yet.
    pub(super) fn is_completed(&self, id: u64) -> bool {
        self.find(id).is_some_and(|i| matches!(self.0[i].1, Lifecycle::Completed(_)))
    }

    /// Whether `id` is posted and not reaped yet.
    pub(super) fn in_flight(&self, id: u64) -> bool {
        self.0.iter().any(|(k, l)| *k == id && !matches!(l, Lifecycle::Completed(_)))
    }

    /// Whether any buffer waits for its completion.
    pub(super) fn any_abandoned(&self) -> bool {
        self.0.iter().any(|(_, l)| matches!(l, Lifecycle::Abandoned { .. }))
    }

    /// Takes every abandoned ticket's buffer (the connection is done with the queue pair).
    pub(super) fn take_abandoned(&mut self) -> Vec<Parked> {
        let mut bufs = Vec::new();
        let mut i = 0;
        while i < self.0.len() {
            if matches!(self.0[i].1, Lifecycle::Abandoned { .. }) {
                if let Lifecycle::Abandoned { buf, .. } = self.0.swap_remove(i).1 {
                    bufs.push(buf);
                }
            } else {
                i += 1;
            }
        }
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
