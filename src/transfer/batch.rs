//! `Batch`: many work requests on borrowed memory, posted with few doorbells and selective
//! signaling, never overflowing the send queue or CQ.

use std::marker::PhantomData;

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::borrowed::{abort_borrowed, InFlight};
use crate::transfer::local::{Local, LocalMut};
use crate::transfer::Connection;
use crate::verbs::{SendFlags, SendOp, Sge, Verb};

/// Collects operations on memory borrowed for `'b`; [`Batch::submit`] posts them in chunks (one
/// doorbell and one signaled completion per chunk; several chunks in flight) and returns only
/// when all have completed. Dropping a batch without submitting posts nothing.
///
/// ```no_run
/// # fn f(conn: &mralloc::transfer::Connection, bufs: &[mralloc::Buffer], remote: &mralloc::RemoteBuf) -> mralloc::Result<()> {
/// let mut batch = conn.batch();
/// for (i, b) in bufs.iter().enumerate() {
///     batch.write(b, remote, (i * 4096) as u64)?;
/// }
/// batch.submit()?;
/// # Ok(()) }
/// ```
pub struct Batch<'c, 'b> {
    conn: &'c Connection,
    sges: Vec<Sge>,
    ops: Vec<SendOp>,
    _borrow: PhantomData<&'b mut ()>,
}

impl Connection {
    /// Starts a batch.
    pub fn batch<'b>(&self) -> Batch<'_, 'b> {
        // Room for a typical batch up front: growing from empty costs a reallocation at 4, 8,
        // 16, ... requests (measured: ~150 instructions per request of a batch of 16).
        Batch { conn: self, sges: Vec::with_capacity(32), ops: Vec::with_capacity(32), _borrow: PhantomData }
    }
}

impl<'b> Batch<'_, 'b> {
    fn push(&mut self, sge: Sge, op: SendOp) -> &mut Self {
        self.sges.push(sge);
        self.ops.push(op);
        self
    }

    /// Adds an RDMA WRITE of `local` to `offset` in `remote`.
    ///
    /// # Errors
    /// Nothing is added, and the batch stays usable, after: the connection's earlier failure;
    /// [`Error::InvalidArgument`] (`local` empty or over `u32::MAX` bytes);
    /// [`Error::NotRegistered`] (`local` not registered in the connection's PD);
    /// [`Error::OutOfBounds`] (the range does not fit in `remote`).
    pub fn write<L: Local + ?Sized>(&mut self, local: &'b L, remote: &RemoteBuf, offset: u64) -> Result<&mut Self> {
        let sge = self.conn.checked(local, Verb::Write)?;
        let to = remote.at(offset, sge.len().into())?;
        Ok(self.push(sge, SendOp::Write(to)))
    }

    /// Adds an RDMA WRITE with immediate.
    ///
    /// # Errors
    /// As [`Batch::write`].
    pub fn write_with_imm<L: Local + ?Sized>(
        &mut self,
        local: &'b L,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> Result<&mut Self> {
        let sge = self.conn.checked(local, Verb::WriteWithImm)?;
        let to = remote.at(offset, sge.len().into())?;
        Ok(self.push(sge, SendOp::WriteWithImm(to, imm)))
    }

    /// Adds an RDMA READ into `local` from `offset` in `remote`.
    ///
    /// # Errors
    /// As [`Batch::write`].
    pub fn read<L: LocalMut + ?Sized>(
        &mut self,
        local: &'b mut L,
        remote: &RemoteBuf,
        offset: u64,
    ) -> Result<&mut Self> {
        let sge = self.conn.checked(&*local, Verb::Read)?;
        let from = remote.at(offset, sge.len().into())?;
        Ok(self.push(sge, SendOp::Read(from)))
    }

    /// Adds a SEND of `local`.
    ///
    /// # Errors
    /// As [`Batch::write`] (no remote range).
    pub fn send<L: Local + ?Sized>(&mut self, local: &'b L) -> Result<&mut Self> {
        let sge = self.conn.checked(local, Verb::Send)?;
        Ok(self.push(sge, SendOp::Send))
    }

    /// Number of operations collected.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether nothing was collected.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Posts everything and waits for all of it. On failure, waits for whatever was posted, then
    /// returns the first error.
    ///
    /// # Errors
    /// The first error:
    /// - posting a chunk: the connection's failure, [`Error::Timeout`] (no send-queue room),
    ///   [`Error::Verbs`] or [`Error::Io`]: later chunks are not posted, earlier ones may have
    ///   been executed; [`Error::PartialPost`] (the connection is failed);
    /// - a chunk's completion, as [`Connection::write_at`] ([`Error::Operation`],
    ///   [`Error::Timeout`], ...), which fails the connection.
    ///
    /// Every posted request has completed or been flushed when this returns (the process aborts
    /// if the device never flushes borrowed memory). An empty batch succeeds.
    pub fn submit(self) -> Result<()> {
        let depth = self.conn.options().send_depth as usize;
        let chunk = (depth / 4).max(1);
        let mut guard = InFlight::new(self.conn);
        let mut tails = Vec::new();
        let mut first_err: Option<Error> = None;
        for (sges, ops) in self.sges.chunks(chunk).zip(self.ops.chunks(chunk)) {
            // SAFETY: every SGE's memory is borrowed for 'b, which outlives this call, and this
            // call returns only after every posted chunk's tail completed or was flushed
            // (in-order RC completion retires the whole chunk); FlushLost aborts, and the guard
            // makes unwinding wait too.
            match unsafe { self.conn.post_chain(sges, ops, SendFlags::NONE) } {
                Ok(t) => {
                    guard.push(t);
                    tails.push(t);
                }
                Err(Error::FlushLost { wr_id, .. }) => abort_borrowed(wr_id),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        for t in tails {
            let r = self.conn.wait(t);
            guard.claimed(t);
            match r {
                Ok(_) => {}
                Err(Error::FlushLost { wr_id, .. }) => abort_borrowed(wr_id),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        guard.disarm();
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
