//! `Batch`: many work requests on borrowed memory, posted with few doorbells and selective
//! signaling, never overflowing the send queue or CQ.

use std::marker::PhantomData;

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::front::borrowed::{abort_borrowed, InFlight};
use crate::transfer::request::parts::{Gather, Scatter};
use crate::transfer::request::{Action, Request, SgeList};
use crate::transfer::Connection;

/// Collects operations on memory borrowed for `'b`; [`Batch::submit`] posts them in chunks (one
/// doorbell and one signaled completion per chunk; several chunks in flight) and returns only
/// when all have completed. Dropping a batch without submitting posts nothing.
///
/// Everything a request names stays borrowed until the batch is submitted — a gather or
/// scatter list ([`Gather`], [`Scatter`]) included, so build lists before the batch (a list
/// made inside the loop that adds requests would not live long enough). Requests go to the
/// queue pair in the order they were added, without a fence: a READ may be executed before
/// an earlier WRITE of the same batch to the same remote bytes has landed; submit a second
/// batch to read what the first wrote. On failure, [`Batch::submit`] reports the first error;
/// which request failed is not told apart.
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
    reqs: Vec<Request>,
    /// Stays on the thread that borrowed its memory.
    _local: PhantomData<*const ()>,
    _borrow: PhantomData<&'b mut ()>,
}

impl Connection {
    /// Starts a batch.
    pub fn batch<'b>(&self) -> Batch<'_, 'b> {
        // Room for a typical batch up front: growing from empty costs a reallocation at 4, 8,
        // 16, ... requests (measured: ~150 instructions per request of a batch of 16).
        Batch { conn: self, reqs: Vec::with_capacity(32), _local: PhantomData, _borrow: PhantomData }
    }
}

impl<'b> Batch<'_, 'b> {
    /// Checks `action` on `sges` and adds it (nothing added on an error).
    #[inline(always)]
    fn push(&mut self, action: Action<'_>, sges: Result<SgeList>) -> Result<&mut Self> {
        let req = self.conn.request(action, sges?)?;
        self.reqs.push(req);
        Ok(self)
    }

    /// Adds an RDMA WRITE of `local` (one buffer, or a gather list: [`Gather`]) to `offset` in
    /// `remote`.
    ///
    /// # Errors
    /// Nothing is added, and the batch stays usable, after: the connection's earlier failure;
    /// [`Error::InvalidArgument`] (`local` or a part empty, over 4 GiB - 1 bytes in all, more
    /// parts than the queue pair's scatter/gather entries);
    /// [`Error::NotRegistered`] (a part not registered in the connection's PD);
    /// [`Error::OutOfBounds`] (the range does not fit in `remote`); [`Error::NotGranted`] (the peer
    /// does not grant `REMOTE_WRITE` — `REMOTE_READ` for a READ —, see
    /// [`Connection::peer_grants`](crate::transfer::Connection::peer_grants)).
    pub fn write<G: Gather + ?Sized>(&mut self, local: &'b G, remote: &RemoteBuf, offset: u64) -> Result<&mut Self> {
        self.push(Action::Write { remote, offset, imm: None }, self.conn.local_sges(local))
    }

    /// Adds an RDMA WRITE with immediate.
    ///
    /// # Errors
    /// As [`Batch::write`].
    pub fn write_with_imm<G: Gather + ?Sized>(
        &mut self,
        local: &'b G,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> Result<&mut Self> {
        self.push(Action::Write { remote, offset, imm: Some(imm) }, self.conn.local_sges(local))
    }

    /// Adds an RDMA READ into `local` (one buffer, or a scatter list: [`Scatter`]) from
    /// `offset` in `remote`.
    ///
    /// # Errors
    /// As [`Batch::write`].
    pub fn read<S: Scatter + ?Sized>(
        &mut self,
        local: &'b mut S,
        remote: &RemoteBuf,
        offset: u64,
    ) -> Result<&mut Self> {
        self.push(Action::Read { remote, offset }, self.conn.local_sges(&*local))
    }

    /// Adds a SEND of `local`.
    ///
    /// # Errors
    /// As [`Batch::write`] (no remote range).
    pub fn send<G: Gather + ?Sized>(&mut self, local: &'b G) -> Result<&mut Self> {
        self.push(Action::Send { imm: None }, self.conn.local_sges(local))
    }

    /// Number of operations collected.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether nothing was collected.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Posts everything and waits for all of it. On failure, waits for whatever was posted, then
    /// returns the first error.
    ///
    /// # Errors
    /// The first error:
    /// - posting a chunk: the connection's failure, [`Error::Timeout`] (no send-queue room),
    ///   [`Error::Verbs`] or [`Error::Io`]: later chunks are not posted, earlier ones may have
    ///   been executed; [`Error::PartialPost`] (the connection is failed);
    /// - a chunk's completion, as [`Connection::write`] ([`Error::Operation`],
    ///   [`Error::Timeout`], ...), which fails the connection.
    ///
    /// Every posted request has completed or been flushed when this returns (the process aborts
    /// if the device never flushes borrowed memory). An empty batch succeeds.
    pub fn submit(self) -> Result<()> {
        let depth = self.conn.options().qp.send_depth as usize;
        let chunk = (depth / 4).max(1);
        let mut guard = InFlight::new(self.conn);
        let mut tails = Vec::new();
        let mut first_err: Option<Error> = None;
        for reqs in self.reqs.chunks(chunk) {
            // SAFETY: every SGE's memory is borrowed for 'b, which outlives this call, and this
            // call returns only after every posted chunk's tail completed or was flushed
            // (in-order RC completion retires the whole chunk); FlushLost aborts, and the guard
            // makes unwinding wait too.
            match unsafe { self.conn.submit(reqs) } {
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
