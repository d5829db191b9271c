//! Non-blocking operations on owned memory.
//!
//! `post_*` takes the local buffer **by value** ([`IoBuf`] / [`IoBufMut`]) and returns a
//! [`Pending`] that owns it until the completion has been reaped; [`Pending::wait`] gives it back.
//! Safe code therefore cannot free or reuse memory the NIC may still touch: dropping a `Pending`
//! parks its buffer with the connection (freed when the completion, or the flush after a failure,
//! is reaped — never blocking), and `mem::forget` on it only leaks the buffer. (Borrowed memory
//! goes through the blocking calls or a [`crate::transfer::Batch`], which return only after
//! their completions.)

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::completion::{Filled, Ticket};
use crate::transfer::iobuf::{IoBuf, IoTarget, Rejected};
use crate::transfer::local::sge_of_parts;
use crate::transfer::ops::nonempty;
use crate::transfer::received::{Posted, Received};
use crate::transfer::Connection;
use crate::verbs::{SendOp, Sge, Verb};

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
    /// the peer's WRITE with immediate consumed it), never more than was posted.
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`]:
    /// - [`Error::Operation`]: the operation failed, or was flushed after another one failed;
    /// - [`Error::Closed`] (or the first failure's [`Error::Verbs`]): it was flushed because the
    ///   connection was closed (or its completion path failed);
    /// - [`Error::Disconnected`]: it was flushed because the connection was found dead (the
    ///   peer went away, the device or port failed);
    /// - [`Error::Timeout`] (the connection's `op_timeout` expired, or for a receive its
    ///   `recv_timeout`, if set), [`Error::Verbs`] or [`Error::Io`] (polling or waiting failed):
    ///   the connection is failed, flushed first.
    ///
    /// - [`Error::Protocol`]: the completion's opcode does not fit the request (a device
    ///   fault): no byte of the buffer is reported written.
    ///
    /// [`Error::FlushLost`] comes without the buffer (leaked: the NIC may still use it).
    pub fn wait(mut self) -> std::result::Result<(B, Received), Rejected<B>> {
        let r = self.conn.wait(self.ticket);
        let mut buf = self.buf.take().expect("a Pending holds its buffer until waited");
        // SAFETY: `c` is this request's successful completion, posted as `self.posted` into
        // `buf` (which the Pending held since).
        match r.and_then(|c| unsafe { c.deliver_into(&mut buf, self.posted, self.fill) }) {
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
    /// A bounds-checked SGE for an owned buffer, or the typed error saying why not.
    pub(crate) fn checked_owned<B: IoBuf>(&self, buf: &B, verb: Verb) -> Result<Sge> {
        self.check()?;
        nonempty(buf.bytes_len(), verb)?;
        sge_of_parts(buf.stable_ptr(), buf.bytes_len(), buf.lkey_for(self.pd()))
    }

    fn post_owned<B: IoBuf>(
        &self,
        buf: B,
        verb: Verb,
        what: impl FnOnce(u64) -> Result<SendOp>,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sge = self.checked_owned(&buf, verb);
        self.post_prepared(buf, sge, what, None)
    }

    /// Posts one request on `buf` whose SGE was checked (`sge`); `fill` records, for a READ
    /// target, that the NIC wrote all of it.
    fn post_prepared<B: Send + 'static>(
        &self,
        buf: B,
        sge: Result<Sge>,
        what: impl FnOnce(u64) -> Result<SendOp>,
        fill: Option<Filled<B>>,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let prepared = sge.and_then(|sge| what(u64::from(sge.len())).map(|w| (sge, w)));
        let (sge, w) = match prepared {
            Ok(x) => x,
            Err(error) => return Err(Rejected { error, buf: Some(buf) }),
        };
        let len = sge.len() as usize;
        let flags = self.inline_flag(&w, len);
        // SAFETY: `buf` moves into the returned Pending, which keeps it until the completion is
        // claimed, parks it with the connection, or leaks it; on FlushLost it is leaked here.
        match unsafe { self.post_chain(&[sge], &[w], flags) } {
            Ok(ticket) => {
                let posted = if fill.is_some() { Posted::Read(len) } else { Posted::Send(len) };
                Ok(Pending { conn: self, ticket, buf: Some(buf), posted, fill })
            }
            Err(error @ Error::FlushLost { .. }) => {
                std::mem::forget(buf);
                Err(Rejected { error, buf: None })
            }
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }

    /// A bounds-checked SGE for a READ or receive target, or the typed error saying why not.
    pub(crate) fn checked_target<B: IoTarget>(&self, buf: &mut B, verb: Verb) -> Result<Sge> {
        self.check()?;
        let (ptr, len) = buf.target();
        nonempty(len, verb)?;
        sge_of_parts(ptr.cast_const(), len, buf.target_lkey(self.pd()))
    }

    /// Starts an RDMA WRITE of all of `buf` to `offset` in `remote`.
    ///
    /// # Errors
    /// The buffer comes back in [`Rejected`], untouched, with:
    /// - the connection's earlier failure ([`Error::Operation`], [`Error::Verbs`],
    ///   [`Error::Closed`]);
    /// - [`Error::InvalidArgument`] (an empty buffer, or over `u32::MAX` bytes),
    ///   [`Error::NotRegistered`] (not registered in this connection's PD),
    ///   [`Error::OutOfBounds`] (the range does not fit in `remote`);
    /// - [`Error::Timeout`] (no send-queue room within the connection's `op_timeout`),
    ///   [`Error::Verbs`] or [`Error::Io`] (the post refused, or waiting for room failed).
    ///
    /// The operation's own failure comes from [`Pending::wait`].
    pub fn post_write<B: IoBuf>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        self.post_owned(buf, Verb::Write, |len| Ok(SendOp::Write(remote.at(offset, len)?)))
    }

    /// Starts an RDMA WRITE with immediate.
    ///
    /// # Errors
    /// As [`Connection::post_write`].
    pub fn post_write_with_imm<B: IoBuf>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        self.post_owned(buf, Verb::WriteWithImm, |len| Ok(SendOp::WriteWithImm(remote.at(offset, len)?, imm)))
    }

    /// Starts an RDMA READ filling all of `buf` from `offset` in `remote`. The target may be
    /// uninitialised memory ([`crate::heap::UninitBuffer`]): after a successful
    /// [`Pending::wait`] all of it is initialised.
    ///
    /// # Errors
    /// As [`Connection::post_write`].
    pub fn post_read<B: IoTarget>(
        &self,
        mut buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sge = self.checked_target(&mut buf, Verb::Read);
        self.post_prepared(buf, sge, |len| Ok(SendOp::Read(remote.at(offset, len)?)), Some(B::filled))
    }

    /// Starts a SEND of all of `buf`.
    ///
    /// # Errors
    /// As [`Connection::post_write`] (no remote range).
    pub fn post_send<B: IoBuf>(&self, buf: B) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        self.post_owned(buf, Verb::Send, |_| Ok(SendOp::Send))
    }

    /// Posts `buf` as a receive buffer; the returned `Pending` completes when the peer's SEND
    /// fills it — or when the peer's RDMA WRITE with immediate consumes it: then nothing is
    /// written into `buf` ([`Received::kind`] is
    /// [`Arrival::ImmediateOnly`](crate::transfer::Arrival), `len` 0, an `UninitBuffer` stays
    /// uninitialised).
    /// Receives complete in the order they were posted. The buffer may be uninitialised memory
    /// ([`crate::heap::UninitBuffer`]): after a successful [`Pending::wait`] the bytes that
    /// arrived are initialised.
    ///
    /// # Errors
    /// As [`Connection::post_write`] (no remote range, no waiting for room): the buffer back
    /// with [`Error::InvalidArgument`] when the receive queue is full, or [`Error::Verbs`] if
    /// the device refuses the receive.
    pub fn post_recv<B: IoTarget>(&self, mut buf: B) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sge = match self.checked_target(&mut buf, Verb::Recv) {
            Ok(s) => s,
            Err(error) => return Err(Rejected { error, buf: Some(buf) }),
        };
        // SAFETY: as in post_owned (a refused receive post touches nothing).
        match unsafe { self.post_recv_raw(std::slice::from_ref(&sge)) } {
            Ok(ticket) => Ok(Pending {
                conn: self,
                ticket,
                buf: Some(buf),
                posted: Posted::Recv(sge.len() as usize),
                fill: Some(B::filled),
            }),
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }
}
