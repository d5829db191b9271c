//! Send-queue requests that found no room, posted strictly in call order.
//!
//! An async send-side operation posts when it is called. If the send queue is full it takes a
//! place here instead, and so does every later one while any place waits: requests reach the
//! NIC in the order they were made (a WRITE then a SEND that announces it stay in that order).
//! Whoever sees room first — the driver after reaping, or any polled operation — posts from the
//! head, so a request whose future is not being polled does not hold the others back.
//!
//! The lock covering this backlog is also what an operation takes to cancel its place, so a
//! request is never posted after its future (which owns the memory) has been dropped.

use std::collections::VecDeque;

use crate::error::Error;
use crate::transfer::engine::completion::Ticket;
use crate::transfer::request::Request;
use crate::transfer::Connection;

#[derive(Default)]
pub(crate) struct Backlog {
    next: u64,
    waiting: VecDeque<(u64, Request)>,
    /// Places posted (the request's ticket) or refused (the error) by a pump.
    resolved: Vec<(u64, Result<Ticket, Error>)>,
}

/// What a dropped operation's place in the backlog had become.
pub(crate) enum Cancelled {
    /// Never posted: the memory is free to go.
    NotPosted,
    /// Posted as this work request: the memory must be parked until it completes.
    Posted(Ticket),
    /// Part of a refused chain whose flush never came (cannot happen for the single requests
    /// queued here; handled anyway): the memory must be leaked.
    Lost,
}

impl Backlog {
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Queues `req` behind every waiting request; returns its place.
    pub(crate) fn push(&mut self, req: Request) -> u64 {
        let t = self.next;
        self.next += 1;
        self.waiting.push_back((t, req));
        t
    }

    /// Posts waiting requests from the head while the send queue has room. Returns whether any
    /// place was resolved (its owner should be woken).
    ///
    /// # Safety
    /// Every waiting request's memory is owned by a live operation that cancels its place
    /// (under the same lock as this call) before it lets the memory go.
    pub(crate) unsafe fn pump(&mut self, conn: &Connection) -> bool {
        let mut any = false;
        while let Some((t, req)) = self.waiting.front() {
            let t = *t;
            // SAFETY: the caller's contract: the memory stays valid until the place is taken
            // (then the operation owns the posted request) or cancelled (then it parks it).
            match unsafe { conn.try_submit(req) } {
                Ok(None) => break,
                Ok(Some(id)) => self.resolved.push((t, Ok(id))),
                Err(e) => self.resolved.push((t, Err(e))),
            }
            self.waiting.pop_front();
            any = true;
        }
        any
    }

    /// The outcome of `place`, once a pump resolved it.
    pub(crate) fn take(&mut self, place: u64) -> Option<Result<Ticket, Error>> {
        let i = self.resolved.iter().position(|(t, _)| *t == place)?;
        Some(self.resolved.swap_remove(i).1)
    }

    /// Withdraws `place` for an operation that is being dropped.
    pub(crate) fn cancel(&mut self, place: u64) -> Cancelled {
        if let Some(i) = self.waiting.iter().position(|(t, _)| *t == place) {
            self.waiting.remove(i);
            return Cancelled::NotPosted;
        }
        match self.take(place) {
            Some(Ok(id)) => Cancelled::Posted(id),
            Some(Err(Error::FlushLost { .. })) => Cancelled::Lost,
            Some(Err(_)) | None => Cancelled::NotPosted,
        }
    }
}
