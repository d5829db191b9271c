//! Posting checked [`Request`]s: the one path from a request to the NIC, with send-queue slot
//! accounting, waiting for room, and what a partially accepted chain leaves behind.
//!
//! Front ends call [`Connection::submit`] (waits for send-queue room: blocking, `Pending`,
//! `Batch`, the connection's own requests) or [`Connection::try_submit`] (never waits, never
//! reaps: the async front end, which posts under its backlog's lock). Both return a [`Ticket`]
//! that every way of waiting takes.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transfer::connection::FLUSH_WAIT;
use crate::transfer::engine::completion::{Completed, Failure, Ticket};
use crate::transfer::request::{Action, Request, SgeList};
use crate::transfer::Connection;
use crate::verbs::{SendOp, SendWr};

/// What one attempt to post a chain did.
enum Attempt {
    /// Posted whole; the signaled tail's id.
    Posted(u64),
    /// No send-queue room: nothing posted.
    Full,
    /// The device accepted only the first `n` requests (the connection must be failed and their
    /// flush awaited).
    Partial(Error, u32),
}

impl Connection {
    /// Posts `chain` — send-queue requests, the last one signaled, or one receive — waiting for
    /// send-queue room first. Returns the tail's ticket.
    ///
    /// If the device accepts only part of the chain, the connection is failed and the accepted
    /// part's flush is awaited before the error is returned.
    ///
    /// # Errors
    /// The connection's failure; [`Error::InvalidArgument`] for an empty chain, one longer than the
    /// send queue, or receives in a chain (or a receive with the receive queue full);
    /// [`Error::Timeout`] (no room within `wait.op_timeout`); [`Error::Verbs`] if the device
    /// refuses the post; [`Error::FlushLost`] if a partial chain's flush never came.
    ///
    /// # Safety
    /// The memory behind every request's entries must stay valid and untouched until the
    /// tail's completion has been claimed with [`Connection::wait`] (or its buffer parked with
    /// the connection) — and, if this returns [`Error::FlushLost`], forever (leak or abort).
    pub(crate) unsafe fn submit(&self, chain: &[Request]) -> Result<Ticket> {
        if let [one] = chain {
            if one.is_recv() {
                // SAFETY: the caller's contract.
                return unsafe { self.submit_recv(one) };
            }
        }
        let k = chain.len() as u32;
        let Some(tail) =
            chain.last().filter(|_| k <= self.options().qp.send_depth && !chain.iter().any(Request::is_recv))
        else {
            return Err(Error::InvalidArgument(format!(
                "a chain holds 1..={} send-queue requests",
                self.options().qp.send_depth
            )));
        };
        self.check()?;
        // The common case: room at once (no clock, no loop).
        // SAFETY: the caller's contract.
        match unsafe { self.attempt(chain, true)? } {
            Attempt::Posted(tail) => Ok(Ticket::send(tail)),
            Attempt::Partial(e, accepted) => Err(self.after_partial(tail.name(), e, accepted)),
            // SAFETY: the caller's contract.
            Attempt::Full => unsafe { self.submit_when_room(chain) },
        }
    }

    /// [`Connection::submit`] once the send queue was found full: waits for room.
    ///
    /// # Safety
    /// As [`Connection::submit`].
    #[inline(never)]
    unsafe fn submit_when_room(&self, chain: &[Request]) -> Result<Ticket> {
        // A chain is reported by its signaled tail.
        let op = chain[chain.len() - 1].name();
        let mut watch = self.core().stopwatch();
        loop {
            self.check()?;
            let mark = self.core().mark();
            // SAFETY: the caller's contract.
            match unsafe { self.attempt(chain, true)? } {
                Attempt::Posted(tail) => return Ok(Ticket::send(tail)),
                Attempt::Partial(e, accepted) => return Err(self.after_partial(op, e, accepted)),
                Attempt::Full => {}
            }
            if watch.elapsed() > self.options().wait.op_timeout {
                return Err(Error::Timeout(self.options().wait.op_timeout, "send-queue room"));
            }
            self.core().pause(&mut 0, Duration::from_millis(1), mark)?;
        }
    }

    /// Posts a memory-less request of the connection's own (a window bind or invalidation) as
    /// [`Connection::submit`] does.
    ///
    /// # Errors
    /// As [`Connection::submit`]; [`Error::InvalidArgument`] for an operation that needs
    /// memory.
    ///
    /// # Safety
    /// As [`Connection::submit`] for whatever the operation names (a bound window's memory).
    pub(crate) unsafe fn submit_control(&self, op: SendOp) -> Result<Ticket> {
        let req = self.request(Action::Control(op), SgeList::Empty)?;
        // SAFETY: the caller's contract.
        unsafe { self.submit(std::slice::from_ref(&req)) }
    }

    /// Posts one request if there is room (`Ok(None)`: the send queue is full, nothing posted),
    /// without waiting and without reaping (the async front end posts under its backlog's lock,
    /// where buffers released by a reap must not be dropped: it reaps first). A receive is
    /// posted or refused.
    ///
    /// # Errors
    /// As [`Connection::submit`], without the timeout.
    ///
    /// # Safety
    /// As [`Connection::submit`].
    pub(crate) unsafe fn try_submit(&self, req: &Request) -> Result<Option<Ticket>> {
        self.check()?;
        if req.is_recv() {
            // SAFETY: the caller's contract.
            return unsafe { self.submit_recv(req) }.map(Some);
        }
        // SAFETY: the caller's contract.
        match unsafe { self.attempt(std::slice::from_ref(req), false)? } {
            Attempt::Posted(id) => Ok(Some(Ticket::send(id))),
            Attempt::Full => Ok(None),
            // A single request is accepted or refused whole (qp.rs reports a refused first
            // request as a plain verbs error); should a device report otherwise, the accepted
            // part's flush is awaited as for any chain (blocking, on this impossible path).
            Attempt::Partial(e, accepted) => Err(self.after_partial(req.name(), e, accepted)),
        }
    }

    /// Posts one receive, if the receive queue has a free slot. Returns its ticket.
    ///
    /// # Safety
    /// As [`Connection::submit`].
    unsafe fn submit_recv(&self, req: &Request) -> Result<Ticket> {
        self.check()?;
        let id = self.core().with_recv_slot(self.options().qp.recv_depth, |id| {
            // SAFETY: the caller keeps the memory valid until the receive is claimed.
            unsafe { self.qp().post_recv(id, req.sges()) }
        })?;
        Ok(Ticket::recv(id))
    }

    /// A partially accepted chain: fails the connection and waits for the accepted part's flush.
    /// Returns the post's error, or [`Error::FlushLost`] if the flush never came.
    fn after_partial(&self, op: &'static str, e: Error, accepted: u32) -> Error {
        self.fail(Failure::local(&e));
        match self.flush_marker(op, accepted) {
            Err(lost @ Error::FlushLost { .. }) => lost,
            _ => e,
        }
    }

    /// One attempt to post `chain` (send-queue requests) ending in a signaled tail; with `reap`,
    /// a full queue is reaped once before giving up.
    ///
    /// # Safety
    /// As [`Connection::submit`].
    unsafe fn attempt(&self, chain: &[Request], reap: bool) -> Result<Attempt> {
        let k = chain.len() as u32;
        let depth = self.options().qp.send_depth;
        self.core().with_send(|core, slots| {
            if slots.used() + k > depth {
                if !reap {
                    return Ok(Attempt::Full);
                }
                // Completions already in the CQ may free the room: look before giving up.
                slots.reap(core)?;
                if slots.used() + k > depth {
                    return Ok(Attempt::Full);
                }
            }
            let first = slots.take_ids(u64::from(k));
            let tail = first + u64::from(k) - 1;
            let r = if let [one] = chain {
                // The common single request: no allocation.
                // SAFETY: the caller keeps the memory valid until the tail completes.
                unsafe { self.qp().post_send(&[one.wr(first, true).expect("a send-queue request")]) }
            } else {
                // Every request is a send-queue one (checked by the callers); the last signaled.
                let wrs: Vec<SendWr<'_>> = (chain.iter().enumerate())
                    .map(|(i, r)| r.wr(first + i as u64, i as u32 == k - 1).expect("a send-queue request"))
                    .collect();
                // SAFETY: as above.
                unsafe { self.qp().post_send(&wrs) }
            };
            let bytes = |n: usize| chain.iter().take(n).map(Request::bytes).sum();
            match r {
                Ok(()) => {
                    slots.posted(tail, k, k, chain[chain.len() - 1].name(), bytes(chain.len()));
                    Ok(Attempt::Posted(tail))
                }
                Err(e @ Error::PartialPost { posted, .. }) => {
                    // The accepted requests use their memory until they complete or are
                    // flushed; none of them is signaled, so a marker will cover them.
                    slots.posted_untracked(posted as u32, bytes(posted));
                    Ok(Attempt::Partial(e, posted as u32))
                }
                Err(e) => Err(e),
            }
        })
    }

    /// After a partially accepted chain (the QP already moved to the error state): posts a
    /// signaled, memory-less marker behind the `accepted` requests and waits for its flush.
    /// Send-queue completions come in order, so the marker's proves that every accepted request
    /// has completed or been flushed — unsignaled requests that completed successfully before
    /// the QP failed report nothing of their own. Returns [`Error::FlushLost`] if the marker
    /// could not be posted or flushed within [`FLUSH_WAIT`].
    fn flush_marker(&self, op: &'static str, accepted: u32) -> Result<Completed> {
        let start = Instant::now();
        let mut spins = 0;
        loop {
            let mark = self.core().mark();
            let marker = Request::marker();
            let posted = self.core().with_send(|core, slots| {
                let id = slots.take_ids(1);
                let marker = [marker.wr(id, true).expect("a send-queue request")];
                // SAFETY: the marker has no memory; a QP in the error state flushes it.
                match unsafe { self.qp().post_send(&marker) } {
                    Ok(()) => {
                        slots.marker_posted(id, accepted + 1, op);
                        Ok(id)
                    }
                    Err(_) => {
                        // Most likely the queue is still full: let the flush make room.
                        let _ = slots.reap(core);
                        Err(id)
                    }
                }
            });
            let id = match posted {
                Ok(id) => return self.wait(Ticket::send(id)),
                Err(id) => id,
            };
            if start.elapsed() > FLUSH_WAIT {
                return Err(Error::FlushLost { wr_id: id, waited: start.elapsed() });
            }
            if self.core().pause(&mut spins, Duration::from_millis(1), mark).is_err() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
