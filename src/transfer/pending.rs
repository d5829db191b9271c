//! Non-blocking operations on owned memory.
//!
//! `post_*` takes the local buffer **by value** and returns a [`Pending`] that owns it until the
//! completion has been reaped; [`Pending::wait`] gives it back. Safe code therefore cannot free
//! or reuse memory the NIC may still touch: dropping a `Pending` waits for its completion, and
//! `mem::forget` on it only leaks the buffer. (Borrowed memory goes through the blocking calls or
//! a [`crate::transfer::Batch`], which return only after their completions.)

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::connection::FLUSH_LOST;
use crate::transfer::local::{Local, LocalMut};
use crate::transfer::ops::Received;
use crate::transfer::Connection;
use crate::verbs::{SendFlags, SendOp};

/// A post that was refused before reaching the NIC: the error, and the buffer back.
#[derive(Debug)]
pub struct Rejected<B> {
    /// Why.
    pub error: Error,
    /// The buffer back: untouched by the NIC if the post was refused, or finished with if the
    /// operation failed. `None` only if the NIC may still own it (a failed connection whose flush
    /// never arrived): then it is leaked rather than freed.
    pub buf: Option<B>,
}

impl<B> std::fmt::Display for Rejected<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.error)
    }
}

impl<B: std::fmt::Debug> std::error::Error for Rejected<B> {}

impl<B> From<Rejected<B>> for Error {
    fn from(r: Rejected<B>) -> Error {
        r.error
    }
}

/// An operation in flight that owns its local buffer.
#[must_use = "dropping a Pending waits for its completion"]
pub struct Pending<'c, B> {
    conn: &'c Connection,
    wr_id: u64,
    send: bool,
    buf: Option<B>,
}

impl<'c, B> Pending<'c, B> {
    /// Whether the completion has arrived (polls the CQ once).
    pub fn is_done(&self) -> bool {
        matches!(self.conn.try_claim_peek(self.wr_id, self.send), Ok(true))
    }

    /// Waits for the completion and returns the buffer (also when the operation failed: the NIC
    /// is done with it either way).
    pub fn wait(mut self) -> std::result::Result<(B, Received), Rejected<B>> {
        let r = if self.send { self.conn.wait_send(self.wr_id) } else { self.conn.wait_recv(self.wr_id) };
        let buf = self.buf.take().expect("a Pending holds its buffer until waited");
        match r {
            Ok(c) => Ok((buf, c.into())),
            Err(e @ Error::Timeout(_, FLUSH_LOST)) => {
                // The NIC may still own the memory: leak it rather than hand it back.
                std::mem::forget(buf);
                Err(Rejected { error: e, buf: None })
            }
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }
}

impl<B> Drop for Pending<'_, B> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let r = if self.send { self.conn.wait_send(self.wr_id) } else { self.conn.wait_recv(self.wr_id) };
            if let Err(Error::Timeout(_, FLUSH_LOST)) = r {
                std::mem::forget(buf);
            }
        }
    }
}

impl Connection {
    pub(crate) fn try_claim_peek(&self, wr_id: u64, send: bool) -> Result<bool> {
        // Claim and put back: cheap, and keeps the map as the single source of truth.
        match self.try_claim(wr_id, send)? {
            Some(o) => {
                self.unclaim(wr_id, send, o);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn post_owned<B: Local>(
        &self,
        buf: B,
        op: &'static str,
        what: impl FnOnce(u64) -> Result<SendOp>,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let prepared = self.checked(&buf, op).and_then(|sge| what(u64::from(sge.len())).map(|w| (sge, w)));
        let (sge, w) = match prepared {
            Ok(x) => x,
            Err(error) => return Err(Rejected { error, buf: Some(buf) }),
        };
        // SAFETY: `buf` moves into the returned Pending, which keeps it until the completion is
        // claimed (or leaks it if the NIC never lets go).
        match unsafe { self.post_chain(op, &[sge], &[w], SendFlags::NONE) } {
            Ok(wr_id) => Ok(Pending { conn: self, wr_id, send: true, buf: Some(buf) }),
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }

    /// Starts an RDMA WRITE of all of `buf` to `offset` in `remote`.
    pub fn post_write<B: Local>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        self.post_owned(buf, "RDMA WRITE", |len| Ok(SendOp::Write(remote.at(offset, len)?)))
    }

    /// Starts an RDMA WRITE with immediate.
    pub fn post_write_with_imm<B: Local>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        self.post_owned(buf, "RDMA WRITE with immediate", |len| Ok(SendOp::WriteWithImm(remote.at(offset, len)?, imm)))
    }

    /// Starts an RDMA READ filling all of `buf` from `offset` in `remote`.
    pub fn post_read<B: LocalMut>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        self.post_owned(buf, "RDMA READ", |len| Ok(SendOp::Read(remote.at(offset, len)?)))
    }

    /// Starts a SEND of all of `buf`.
    pub fn post_send<B: Local>(&self, buf: B) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        self.post_owned(buf, "SEND", |_| Ok(SendOp::Send))
    }

    /// Posts `buf` as a receive buffer; the returned `Pending` completes when a SEND fills it.
    /// Receives complete in the order they were posted.
    pub fn post_recv<B: LocalMut>(&self, buf: B) -> std::result::Result<Pending<'_, B>, Rejected<B>> {
        let sge = match self.checked(&buf, "receive") {
            Ok(s) => s,
            Err(error) => return Err(Rejected { error, buf: Some(buf) }),
        };
        // SAFETY: as in post_owned.
        match unsafe { self.post_recv_raw(Some(sge)) } {
            Ok(wr_id) => Ok(Pending { conn: self, wr_id, send: false, buf: Some(buf) }),
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }
}
