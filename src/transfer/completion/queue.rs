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

/// A few (id, value) pairs: completions are claimed quickly, so these stay tiny and a linear
/// scan beats hashing on the hot path.
pub(super) struct Small<T>(Vec<(u64, T)>);

impl<T> Default for Small<T> {
    fn default() -> Small<T> {
        Small(Vec::with_capacity(8))
    }
}

impl<T> Small<T> {
    pub(super) fn insert(&mut self, id: u64, v: T) {
        self.0.push((id, v));
    }
    pub(super) fn remove(&mut self, id: u64) -> Option<T> {
        let i = self.0.iter().position(|(k, _)| *k == id)?;
        Some(self.0.swap_remove(i).1)
    }
    pub(super) fn contains(&self, id: u64) -> bool {
        self.0.iter().any(|(k, _)| *k == id)
    }
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub(super) fn take_all(&mut self) -> Vec<T> {
        self.0.drain(..).map(|(_, v)| v).collect()
    }
}

/// What a queue (send or receive) keeps about its requests.
pub(super) struct Queue {
    /// Completions reaped but not yet claimed by their waiter.
    pub(super) done: Small<Outcome>,
    /// Buffers of requests nobody waits for, released when their completion is reaped.
    pub(super) parked: Small<Parked>,
    /// Parked buffers whose completion was reaped: dropped once the lock is released.
    pub(super) released: Vec<Parked>,
    /// A flush reaped that no waiter will explain (see the module docs): recorded once the
    /// lock is released.
    pub(super) orphan: Option<Failure>,
    /// Slots in use (posted, not yet retired by a completion).
    pub(super) used: u32,
    /// Send queue: for each signaled request, how many slots its completion retires and its
    /// operation. (Receives retire one slot each.)
    pub(super) tails: Small<(u32, &'static str)>,
    /// Reused poll buffer.
    pub(super) wcs: [WorkCompletion; 8],
    /// What this queue posted and reaped (for `Connection::stats`).
    pub(super) counts: QueueCounts,
}

impl Default for Queue {
    fn default() -> Queue {
        Queue {
            done: Small::default(),
            parked: Small::default(),
            released: Vec::new(),
            orphan: None,
            used: 0,
            tails: Small::default(),
            wcs: std::array::from_fn(|_| WorkCompletion::empty()),
            counts: QueueCounts::default(),
        }
    }
}
