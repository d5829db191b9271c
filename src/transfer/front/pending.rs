//! Non-blocking operations on owned memory.
//!
//! `post_*` takes the local memory **by value** — one buffer ([`IoBuf`] / [`IoTarget`]), or a
//! gather/scatter list of them (`Vec<B>`, `[B; N]`) that one work request carries in order —
//! and returns a [`Pending`] that owns it until the completion has been reaped;
//! [`Pending::wait`] gives it back (the whole list). Safe code therefore cannot free or reuse
//! memory the NIC may still touch: dropping a `Pending` parks its memory (every part of a list)
//! with the connection (freed when the completion, or the flush after a failure, is reaped —
//! never blocking), and `mem::forget` on it only leaks it. (Borrowed memory goes through the
//! blocking calls or a [`crate::transfer::Batch`], which return only after their completions.)
//!
//! ```no_run
//! # fn f(conn: &mralloc::transfer::Connection, heap: &mralloc::Heap) -> mralloc::Result<()> {
//! let (header, payload) = (heap.alloc(16)?, heap.alloc(1 << 20)?);
//! let pending = conn.post_send(vec![header, payload])?; // one SEND, two entries
//! let (parts, _) = pending.wait()?; // both buffers back, in order
//! let inbox = conn.post_recv([heap.alloc(16)?, heap.alloc(1 << 20)?])?;
//! let ([head, body], got) = inbox.wait()?; // filled in order; `got.len` bytes in all
//! # drop((parts, head, body, got)); Ok(()) }
//! ```

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::engine::completion::{Filled, Ticket};
use crate::transfer::request::iobuf::Rejected;
#[cfg(doc)]
use crate::transfer::request::iobuf::{IoBuf, IoTarget};
use crate::transfer::request::owned::{OwnedGather, OwnedScatter};
use crate::transfer::request::received::{Posted, Received};
use crate::transfer::request::{Action, SgeList};
use crate::transfer::Connection;

/// An operation in flight that owns its local buffer.
///
/// [`Pending::wait`] returns the buffer once the NIC is done with it. Dropping a `Pending`
/// returns at once: the buffer stays with the connection until the operation's completion (or
/// its flush, if the connection fails or is closed) is reaped, then it is freed. Dropping a
/// posted receive leaves it posted: the next SEND the peer makes lands in it and is discarded.
/// Forgetting a `Pending` (`mem::forget`) leaks the buffer; the NIC never touches freed memory.
#[must_use = "dropping a Pending leaves the operation running; its buffer is freed when it completes"]
pub struct Pending<'c, B: Send + 'static> {
    conn: &'c Connection,
    ticket: Ticket,
    buf: Option<B>,
    /// What was posted: the length the completion is interpreted against.
    posted: Posted,
    /// For a READ or receive target: records what the NIC wrote.
    fill: Option<Filled<B>>,
}

impl<B: Send + 'static> std::fmt::Debug for Pending<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("wr_id", &self.ticket.wr_id).field("send", &self.ticket.send).finish()
    }
}

impl<'c, B: Send + 'static> Pending<'c, B> {
    /// Whether the completion has arrived (polls the CQ once). A failing poll reads as `false`:
    /// [`Pending::wait`] reports it.
    pub fn is_done(&self) -> bool {
        !self.conn.forked_copy() && matches!(self.conn.core().is_done(self.ticket), Ok(true))
    }

    /// Waits for the completion and returns the buffer (also when the operation failed: the NIC
    /// is done with it either way) with what the operation delivered: for a receive, which kind
    /// of message arrived and how many bytes of the buffer it wrote ([`Received`]; none when
    /// the peer's WRITE with immediate consumed it), never more than was posted. For a SEND,
    /// WRITE or READ only [`Received`]'s length means something (the bytes the request moved);
    /// its kind and immediate describe arrivals.
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`]:
    /// - [`Error::Operation`]: the operation failed, or was flushed after another one failed;
    /// - [`Error::Closed`] (or the first failure's [`Error::Verbs`]): it was flushed because the
    ///   connection was closed (or its completion path failed);
    /// - [`Error::Disconnected`]: it was flushed because the connection was found dead (the
    ///   peer went away, the device or port failed);
    /// - [`Error::Timeout`] (the connection's `wait.op_timeout` expired, or for a receive its
    ///   `wait.recv_timeout`, if set), [`Error::Verbs`] or [`Error::Io`] (polling or waiting
    ///   failed): the connection is failed, flushed first.
    ///
    /// - [`Error::Protocol`]: the completion's opcode does not fit the request (a device
    ///   fault): no byte of the buffer is reported written.
    ///
    /// [`Error::FlushLost`] comes without the buffer (leaked: the NIC may still use it).
    pub fn wait(mut self) -> std::result::Result<(B, Received), Rejected<B>> {
        // Should the wait unwind, the Pending's drop parks the buffer.
        let r = self.conn.wait(self.ticket);
        let mut buf = self.buf.take().expect("a Pending holds its buffer until waited");
        let (posted, fill) = (self.posted, self.fill);
        // Nothing left to drop: the buffer is out, the rest is `Copy`.
        std::mem::forget(self);
        // SAFETY: `c` is this request's successful completion, posted as `posted` into `buf`
        // (which the Pending held since).
        match r.and_then(|c| unsafe { c.deliver_into(&mut buf, posted, fill) }) {
            Ok(got) => Ok((buf, got)),
            Err(error @ Error::FlushLost { .. }) => {
                // The NIC may still own the memory: leak it rather than hand it back.
                std::mem::forget(buf);
                Err(Rejected { error, buf: None })
            }
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }
}

impl<B: Send + 'static> Drop for Pending<'_, B> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            if self.conn.forked_copy() {
                // A fork()ed child's copy: the parent's NIC may use the memory; its lock may be
                // held. Keep the buffer for good.
                std::mem::forget(buf);
                return;
            }
            self.conn.core().park(self.ticket, Box::new(buf));
        }
    }
}

impl Connection {
    /// All of `buf` (one owned buffer or a list) as a request's memory (checked as
    /// [`Connection::local_sges`] checks borrowed memory).
    #[inline]
    pub(crate) fn owned_sges<B: OwnedGather>(&self, buf: &B) -> Result<SgeList> {
        self.check()?;
        buf.sge_list(self.pd())
    }

    /// All of a READ or receive target `buf` (one owned target or a list) as a request's memory.
    #[inline]
    pub(crate) fn target_sges<B: OwnedScatter>(&self, buf: &mut B) -> Result<SgeList> {
        self.check()?;
        buf.target_list(self.pd())
    }

    /// Checks `action` on `sges` (`buf`'s memory, or why it has none), posts it and hands back
    /// a [`Pending`] owning `buf`; `fill` records, for a READ or receive target, what the NIC
    /// wrote. A refusal gives `buf` back untouched.
    #[inline(always)]
    fn post_owned<B: Send + 'static>(
        &self,
        buf: B,
        sges: Result<SgeList>,
        action: Action<'_>,
        fill: Option<Filled<B>>,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let req = match sges.and_then(|sges| self.request(action, sges)) {
            Ok(req) => req,
            Err(error) => return Err(Rejected { error, buf: Some(buf) }),
        };
        // SAFETY: `buf` moves into the returned Pending, which keeps it until the completion is
        // claimed, parks it with the connection, or leaks it; on FlushLost it is leaked here.
        match unsafe { self.submit(std::slice::from_ref(&req)) } {
            Ok(ticket) => Ok(Pending { conn: self, ticket, buf: Some(buf), posted: req.posted(), fill }),
            Err(error @ Error::FlushLost { .. }) => {
                std::mem::forget(buf);
                Err(Rejected { error, buf: None })
            }
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }

    /// Starts an RDMA WRITE of all of `buf` to `offset` in `remote`: one owned buffer
    /// ([`IoBuf`]), or a gather list of them (`Vec<B>`, `[B; N]`) written as the concatenation
    /// of its parts, which the `Pending` gives back whole.
    ///
    /// ```no_run
    /// # fn f(conn: &mralloc::transfer::Connection, heap: &mralloc::Heap, remote: &mralloc::RemoteBuf) -> mralloc::Result<()> {
    /// use mralloc::transfer::IoBuf;
    /// let (header, payload) = (heap.alloc(64)?, heap.alloc(1 << 20)?);
    /// let pending = conn.post_write([header.into_slice(..16)?, payload.into_slice(..)?], remote, 0)?;
    /// let ([header, payload], _) = pending.wait()?;
    /// # drop((header, payload)); Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The buffer (all of a list) comes back in [`Rejected`], untouched, with:
    /// - the connection's earlier failure ([`Error::Operation`], [`Error::Verbs`],
    ///   [`Error::Closed`]);
    /// - [`Error::InvalidArgument`] (an empty buffer or part, no parts, more parts than the
    ///   queue pair's scatter/gather entries, over 4 GiB - 1 bytes in all),
    ///   [`Error::NotRegistered`] (a part not registered in this connection's PD),
    ///   [`Error::OutOfBounds`] (the range does not fit in `remote`), [`Error::NotGranted`] (the
    ///   peer does not grant `REMOTE_WRITE` — `REMOTE_READ` for a READ —, see
    ///   [`Connection::peer_grants`]);
    /// - [`Error::Timeout`] (no send-queue room within the connection's `op_timeout`),
    ///   [`Error::Verbs`] or [`Error::Io`] (the post refused, or waiting for room failed).
    ///
    /// The operation's own failure comes from [`Pending::wait`].
    pub fn post_write<B: OwnedGather>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sges = self.owned_sges(&buf);
        self.post_owned(buf, sges, Action::Write { remote, offset, imm: None }, None)
    }

    /// Starts an RDMA WRITE with immediate.
    ///
    /// # Errors
    /// As [`Connection::post_write`].
    pub fn post_write_with_imm<B: OwnedGather>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sges = self.owned_sges(&buf);
        self.post_owned(buf, sges, Action::Write { remote, offset, imm: Some(imm) }, None)
    }

    /// Starts an RDMA READ filling all of `buf` from `offset` in `remote`: one owned target
    /// ([`IoTarget`]), or a scatter list of them (`Vec<B>`, `[B; N]`) filled in order (at
    /// most the device's `max_sge_rd` parts). The target may be uninitialised memory
    /// ([`crate::heap::UninitBuffer`]): after a successful [`Pending::wait`] all of it is
    /// initialised.
    ///
    /// # Errors
    /// As [`Connection::post_write`].
    pub fn post_read<B: OwnedScatter>(
        &self,
        mut buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sges = self.target_sges(&mut buf);
        self.post_owned(buf, sges, Action::Read { remote, offset }, Some(B::filled))
    }

    /// Starts a SEND of all of `buf`: one owned buffer, or a gather list of them (`Vec<B>`,
    /// `[B; N]`) sent as one message, the concatenation of its parts.
    ///
    /// # Errors
    /// As [`Connection::post_write`] (no remote range).
    pub fn post_send<B: OwnedGather>(&self, buf: B) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sges = self.owned_sges(&buf);
        self.post_owned(buf, sges, Action::Send { imm: None }, None)
    }

    /// Posts `buf` as a receive: one owned target, or a scatter list of them (`Vec<B>`,
    /// `[B; N]`; at most `qp().caps().max_recv_sge` parts) filled in order, the first part,
    /// then the next. The returned `Pending` completes when the peer's SEND fills it
    /// ([`Received::len`]: the bytes that landed, in all parts together) — or when the peer's
    /// RDMA WRITE with immediate consumes it: then nothing is written into `buf`
    /// ([`Received::kind`] is [`Arrival::ImmediateOnly`](crate::transfer::Arrival), `len` 0, an
    /// `UninitBuffer` stays uninitialised).
    /// Receives complete in the order they were posted. The buffer may be uninitialised memory
    /// ([`crate::heap::UninitBuffer`]): after a successful [`Pending::wait`] the bytes that
    /// arrived are initialised.
    ///
    /// # Errors
    /// As [`Connection::post_write`] (no remote range, no waiting for room): the buffer back
    /// with [`Error::InvalidArgument`] when the receive queue is full, or [`Error::Verbs`] if
    /// the device refuses the receive.
    pub fn post_recv<B: OwnedScatter>(&self, mut buf: B) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sges = self.target_sges(&mut buf);
        self.post_owned(buf, sges, Action::Recv, Some(B::filled))
    }
}
