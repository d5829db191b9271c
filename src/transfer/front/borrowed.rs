//! Operations on *borrowed* memory (the blocking API): the one place they post and wait, and
//! what makes sure a borrow never ends while the NIC may still use the memory — unwinding
//! waits for the flush, and a device that never flushes aborts the process.

use crate::error::{Error, Result};
use crate::transfer::engine::completion::{Completed, Failure, Ticket};
use crate::transfer::request::received::Received;
use crate::transfer::request::{Action, SgeList};
use crate::transfer::Connection;
use crate::verbs::WcStatus;

/// Makes unwinding past an operation on borrowed memory wait for its completion (or its flush)
/// before the borrow ends; aborts if the device never lets go. Disarmed on the normal path.
pub(crate) struct InFlight<'c> {
    conn: &'c Connection,
    /// The first request covered (a blocking operation's only one: no allocation).
    one: Option<Ticket>,
    /// Any further ones (a batch's chunks).
    more: Vec<Ticket>,
}

impl<'c> InFlight<'c> {
    pub(crate) fn new(conn: &'c Connection) -> InFlight<'c> {
        InFlight { conn, one: None, more: Vec::new() }
    }

    /// Covers one more posted request (its completion must be claimed before the borrow ends).
    pub(crate) fn push(&mut self, t: Ticket) {
        if self.one.is_none() && self.more.is_empty() {
            self.one = Some(t);
        } else {
            self.more.push(t);
        }
    }

    /// `t`'s completion was claimed: nothing to wait for on unwinding.
    pub(crate) fn claimed(&mut self, t: Ticket) {
        if self.one == Some(t) {
            self.one = None;
        } else {
            self.more.retain(|&i| i != t);
        }
    }

    /// The normal path: every request was claimed.
    pub(crate) fn disarm(mut self) {
        let more = std::mem::take(&mut self.more);
        // Nothing to wait for: the guard's drop has no work (its list is dropped here).
        std::mem::forget(self);
        drop(more);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let Some(first) = self.one.or_else(|| self.more.first().copied()) else {
            return;
        };
        self.conn.fail(Failure::Op {
            op: "an operation abandoned by a panic",
            wr_id: first.wr_id,
            status: WcStatus::GeneralErr,
            vendor_err: 0,
        });
        for t in self.one.into_iter().chain(self.more.iter().copied()) {
            if let Err(Error::FlushLost { .. }) = self.conn.wait(t) {
                abort_borrowed(t.wr_id);
            }
        }
    }
}

/// The one way out when the NIC may still use *borrowed* memory: returning would hand that
/// memory back to safe code.
pub(crate) fn abort_borrowed(wr_id: u64) -> ! {
    eprintln!(
        "mralloc: the RDMA device did not flush work request {wr_id} after its queue pair was moved to the error \
         state; its borrowed memory may still be written: aborting"
    );
    std::process::abort();
}

impl Connection {
    /// Checks `action` on borrowed `sges`, posts it, waits for it and interprets its
    /// completion: the one place blocking operations post. Returns only when the NIC is done
    /// with the memory; aborts the process if the device never releases it.
    #[inline(always)]
    pub(crate) fn run_borrowed(&self, action: Action<'_>, sges: SgeList) -> Result<Received> {
        let req = self.request(action, sges)?;
        // No memory to guard (a receive for an immediate): there a lost flush is an error.
        let borrowed = !req.sges().is_empty();
        // SAFETY: the memory is borrowed by our caller for this whole call, and we do not return
        // before the request's completion (or its flush) is claimed; FlushLost aborts.
        let t = match unsafe { self.submit(std::slice::from_ref(&req)) } {
            Err(Error::FlushLost { wr_id, .. }) if borrowed => abort_borrowed(wr_id),
            r => r?,
        };
        let got = if borrowed { self.wait_borrowed(t)? } else { self.wait(t)? };
        got.delivered(req.posted())
    }

    /// Waits for `t`, posted on *borrowed* memory: unwinding out of the wait waits for the
    /// flush too (the `InFlight` guard), and a flush that never comes aborts the process rather
    /// than end the borrow.
    pub(crate) fn wait_borrowed(&self, t: Ticket) -> Result<Completed> {
        let mut guard = InFlight::new(self);
        guard.push(t);
        let r = self.wait(t);
        guard.disarm();
        match r {
            Err(Error::FlushLost { wr_id, .. }) => abort_borrowed(wr_id),
            r => r,
        }
    }
}
