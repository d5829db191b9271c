//! A connection's per-queue bookkeeping: tickets, the outcomes reaped for them, the buffers
//! parked on them, the send queue's slots.

use std::collections::HashMap;

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

    /// The work request's id (what a completion, and an `Error::Operation`, name it by).
    pub(crate) fn wr_id(&self) -> u64 {
        self.wr_id
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

/// A queue's tickets by work-request id: a ring indexed by the id's low bits, so a lookup is
/// one load and a compare. A queue's ids are consecutive (each queue numbers its own requests)
/// and it completes them in order, so the requests in flight — at most the queue's depth —
/// fit the ring without sharing a slot once it has grown to twice that (it starts small and
/// doubles when two requests in flight meet: an idle connection costs little). A ticket that
/// does lose its slot (an outcome nobody claimed for a turn of the ring, a keepalive probe's
/// id) waits in `spill`, a map looked at only when it is not empty.
pub(super) struct Tickets {
    ring: Box<[Option<(u64, Lifecycle)>]>,
    mask: u64,
    /// The ring's largest size: twice the queue's depth, rounded up to a power of two.
    max: usize,
    /// Tickets whose ring slot was taken.
    spill: HashMap<u64, Lifecycle>,
    /// How many are `Abandoned` (so "anything parked?" costs nothing).
    abandoned: usize,
    /// How many are `Completed` (so a waiter that finds none reaps without looking).
    completed: usize,
}

/// Where a ticket is ([`Tickets::find`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum At {
    Ring(usize),
    Spill(u64),
}

/// The ring's first size.
const FIRST_RING: usize = 16;

impl Tickets {
    /// A table for a queue of `depth` requests in flight.
    pub(super) fn new(depth: u32) -> Tickets {
        let max = (depth.max(8) as usize).next_power_of_two() * 2;
        let n = FIRST_RING.min(max);
        Tickets { ring: empty_ring(n), mask: n as u64 - 1, max, spill: HashMap::new(), abandoned: 0, completed: 0 }
    }

    /// A request posted as `id` (signaled: its completion will be reaped). A completed ticket
    /// in its slot (left unclaimed for a turn of the ring) moves to the spill; one still in
    /// flight makes the ring grow (up to its largest size; past it, the spill takes it).
    #[inline(always)]
    pub(super) fn submitted(&mut self, id: u64, retires: u32, op: &'static str) {
        let slot = &mut self.ring[(id & self.mask) as usize];
        if slot.is_none() {
            *slot = Some((id, Lifecycle::Submitted { retires, op }));
        } else {
            self.submitted_taken(id, retires, op);
        }
    }

    /// [`Tickets::submitted`] where the slot is taken.
    #[cold]
    #[inline(never)]
    fn submitted_taken(&mut self, id: u64, retires: u32, op: &'static str) {
        let entry = (id, Lifecycle::Submitted { retires, op });
        let i = (id & self.mask) as usize;
        match &self.ring[i] {
            None => self.ring[i] = Some(entry),
            Some((_, Lifecycle::Completed(_))) => {
                let old = self.ring[i].replace(entry);
                self.spill.extend(old);
            }
            Some(_) if self.ring.len() < self.max => {
                self.grow();
                self.submitted(id, retires, op);
            }
            Some(_) => {
                self.spill.insert(id, entry.1);
            }
        }
    }

    /// Doubles the ring, every ticket moving to its slot in it (or to the spill if taken).
    #[cold]
    fn grow(&mut self) {
        let n = self.ring.len() * 2;
        let old = std::mem::replace(&mut self.ring, empty_ring(n));
        self.mask = n as u64 - 1;
        for (id, l) in old.into_vec().into_iter().flatten() {
            let slot = &mut self.ring[(id & self.mask) as usize];
            if slot.is_none() {
                *slot = Some((id, l));
            } else {
                self.spill.insert(id, l);
            }
        }
    }

    /// Where `id` is in the table.
    #[inline(always)]
    pub(super) fn find(&self, id: u64) -> Option<At> {
        let i = (id & self.mask) as usize;
        match &self.ring[i] {
            Some((k, _)) if *k == id => Some(At::Ring(i)),
            _ if self.spill.is_empty() => None,
            _ => self.spill.contains_key(&id).then_some(At::Spill(id)),
        }
    }

    #[inline(always)]
    fn lifecycle(&mut self, at: At) -> &mut Lifecycle {
        match at {
            At::Ring(i) => &mut self.ring[i].as_mut().expect("a ticket found in the table").1,
            At::Spill(id) => self.spill.get_mut(&id).expect("a ticket found in the table"),
        }
    }

    /// The ticket at `at` ([`Tickets::find`]).
    #[inline(always)]
    pub(super) fn at(&self, at: At) -> &Lifecycle {
        match at {
            At::Ring(i) => &self.ring[i].as_ref().expect("a ticket found in the table").1,
            At::Spill(id) => &self.spill[&id],
        }
    }

    /// The ticket at `at` completed with `o` (it was `Submitted`).
    #[inline(always)]
    pub(super) fn complete(&mut self, at: At, o: Outcome) {
        let l = self.lifecycle(at);
        debug_assert!(matches!(l, Lifecycle::Submitted { .. }));
        *l = Lifecycle::Completed(o);
        self.completed += 1;
    }

    /// Nobody waits for the `Submitted` ticket at `at` any more: `buf` stays until its
    /// completion is reaped.
    pub(super) fn abandon(&mut self, at: At, buf: Parked) {
        let l = self.lifecycle(at);
        let Lifecycle::Submitted { retires, op } = *l else { unreachable!("only a submitted ticket is abandoned") };
        *l = Lifecycle::Abandoned { retires, op, buf };
        self.abandoned += 1;
    }

    /// Takes the ticket at `at` out of the table.
    #[inline(always)]
    pub(super) fn remove_at(&mut self, at: At) -> Lifecycle {
        let l = match at {
            At::Ring(i) => self.ring[i].take().expect("a ticket found in the table").1,
            At::Spill(id) => self.spill.remove(&id).expect("a ticket found in the table"),
        };
        match l {
            Lifecycle::Abandoned { .. } => self.abandoned -= 1,
            Lifecycle::Completed(_) => self.completed -= 1,
            Lifecycle::Submitted { .. } => {}
        }
        l
    }

    /// Takes `id`'s outcome if it has completed (else leaves it be).
    #[inline(always)]
    pub(super) fn claim(&mut self, id: u64) -> Option<Outcome> {
        let i = (id & self.mask) as usize;
        match &self.ring[i] {
            Some((k, Lifecycle::Completed(_))) if *k == id => match self.ring[i].take() {
                Some((_, Lifecycle::Completed(o))) => {
                    self.completed -= 1;
                    Some(o)
                }
                _ => None,
            },
            Some((k, _)) if *k == id => None,
            _ if self.spill.is_empty() => None,
            _ => self.claim_spilled(id),
        }
    }

    #[inline(never)]
    fn claim_spilled(&mut self, id: u64) -> Option<Outcome> {
        if !matches!(self.spill.get(&id)?, Lifecycle::Completed(_)) {
            return None;
        }
        match self.spill.remove(&id) {
            Some(Lifecycle::Completed(o)) => {
                self.completed -= 1;
                Some(o)
            }
            _ => None,
        }
    }

    /// Whether `id` has completed, its outcome not claimed yet.
    pub(super) fn is_completed(&self, id: u64) -> bool {
        self.find(id).is_some_and(|i| matches!(self.at(i), Lifecycle::Completed(_)))
    }

    /// Whether `id` is posted and not reaped yet.
    pub(super) fn in_flight(&self, id: u64) -> bool {
        self.find(id).is_some_and(|i| !matches!(self.at(i), Lifecycle::Completed(_)))
    }

    /// Whether any outcome waits to be claimed.
    #[inline(always)]
    pub(super) fn any_completed(&self) -> bool {
        self.completed > 0
    }

    /// Whether any buffer waits for its completion.
    #[inline]
    pub(super) fn any_abandoned(&self) -> bool {
        self.abandoned > 0
    }

    /// Takes every abandoned ticket's buffer (the connection is done with the queue pair).
    pub(super) fn take_abandoned(&mut self) -> Vec<Parked> {
        let mut bufs = Vec::new();
        for e in self.ring.iter_mut() {
            if matches!(e, Some((_, Lifecycle::Abandoned { .. }))) {
                if let Some((_, Lifecycle::Abandoned { buf, .. })) = e.take() {
                    bufs.push(buf);
                }
            }
        }
        let spilled: Vec<u64> =
            self.spill.iter().filter(|(_, l)| matches!(l, Lifecycle::Abandoned { .. })).map(|(id, _)| *id).collect();
        for id in spilled {
            if let Some(Lifecycle::Abandoned { buf, .. }) = self.spill.remove(&id) {
                bufs.push(buf);
            }
        }
        self.abandoned = 0;
        bufs
    }

    /// Tickets in the table (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.ring.iter().flatten().count() + self.spill.len()
    }
}

fn empty_ring(n: usize) -> Box<[Option<(u64, Lifecycle)>]> {
    (0..n).map(|_| None).collect()
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
    /// The next work-request id: each queue numbers its own requests (under its lock), so the
    /// ids it has in flight are consecutive — what its ticket table is indexed by.
    pub(super) next_id: u64,
}

impl Queue {
    /// A queue of `depth` requests in flight, numbering them from `first_id`.
    pub(super) fn new(depth: u32, first_id: u64) -> Queue {
        Queue {
            tickets: Tickets::new(depth),
            released: Vec::new(),
            orphan: None,
            used: 0,
            wcs: std::array::from_fn(|_| WorkCompletion::empty()),
            counts: QueueCounts::default(),
            next_id: first_id,
        }
    }

    /// `k` consecutive work-request ids; returns the first.
    #[inline(always)]
    pub(super) fn take_ids(&mut self, k: u64) -> u64 {
        let first = self.next_id;
        self.next_id += k;
        first
    }
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
