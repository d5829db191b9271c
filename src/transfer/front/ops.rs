//! Blocking operations: post, wait for the completion, return. The local memory is borrowed for
//! the call, which does not return while the NIC may still touch it.

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::request::parts::{Gather, Parts, Scatter};
use crate::transfer::request::received::Received;
use crate::transfer::request::{Action, SgeList};
use crate::transfer::Connection;

/// The immediate a receive of no bytes (posted by `recv_imm`) delivered, or why there is none.
pub(crate) fn immediate_of(got: Received) -> Result<u32> {
    got.imm.ok_or_else(|| Error::Protocol("expected an immediate, got an empty SEND without one".into()))
}

impl Connection {
    /// RDMA WRITE of all of `local` — one buffer, or a gather list written as the
    /// concatenation of its parts ([`Gather`]) — to `offset` bytes into `remote`
    /// (bounds-checked here).
    ///
    /// ```no_run
    /// # fn f(conn: &mralloc::transfer::Connection, header: &mralloc::Buffer, payload: &mralloc::Buffer, remote: &mralloc::RemoteBuf) -> mralloc::Result<()> {
    /// conn.write(payload, remote, 0)?;
    /// conn.write(&[&header[..16], &payload[..]], remote, 4096)?; // one request, two parts
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// - The connection's earlier failure, at once ([`Error::Operation`], [`Error::Verbs`],
    ///   [`Error::Closed`]).
    /// - Nothing posted, the connection still usable: [`Error::InvalidArgument`] (`local` or a
    ///   part empty, over 4 GiB - 1 bytes in all, more parts than the queue pair's
    ///   scatter/gather entries), [`Error::NotRegistered`] (a part not registered in
    ///   [`Connection::pd`]), [`Error::OutOfBounds`] (the range does not fit in `remote`),
    ///   [`Error::NotGranted`] (the peer's queue pair does not grant the right the request
    ///   needs, [`Connection::peer_grants`]: `REMOTE_WRITE` here),
    ///   [`Error::Timeout`] (no send-queue room within
    ///   [`Options::op_timeout`](crate::transfer::WaitOptions::op_timeout)), [`Error::Verbs`] or
    ///   [`Error::Io`] (the post refused, or waiting for room failed).
    /// - Posted, and the connection failed: [`Error::Operation`] (a failed completion, e.g.
    ///   `REM_ACCESS_ERR` when the peer's key, range or
    ///   [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access) does not allow
    ///   it), [`Error::Timeout`] (no completion within `wait.op_timeout`), [`Error::Verbs`] or
    ///   [`Error::Io`] (polling or waiting failed). It returns once the NIC is done with `local`;
    ///   if the device never flushes the request, the process aborts.
    pub fn write<G: Gather + ?Sized>(&self, local: &G, remote: &RemoteBuf, offset: u64) -> Result<()> {
        self.run_borrowed(Action::Write { remote, offset, imm: None }, self.local_sges(local)?).map(|_| ())
    }

    /// RDMA WRITE that also delivers `imm` to the peer. It consumes one of the peer's posted
    /// receives ([`Connection::recv_imm`], or any `recv`/`post_recv`: that receive's buffer is
    /// left untouched and reports [`Arrival::ImmediateOnly`](crate::transfer::Arrival)); the
    /// WRITE's bytes are in the target once that receive completes.
    ///
    /// # Errors
    /// As [`Connection::write`] (the peer must have a receive posted).
    pub fn write_with_imm<G: Gather + ?Sized>(
        &self,
        local: &G,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> Result<()> {
        self.run_borrowed(Action::Write { remote, offset, imm: Some(imm) }, self.local_sges(local)?).map(|_| ())
    }

    /// RDMA READ from `offset` bytes into `remote`, filling all of `local` — one buffer, or a
    /// scatter list filled in order ([`Scatter`]).
    ///
    /// # Errors
    /// As [`Connection::write`] (the peer must grant `REMOTE_READ`, else
    /// [`Error::NotGranted`]). Memory registered
    /// without `LOCAL_WRITE` (a read-only [`MappedFile`](crate::transfer::MappedFile)) fails the
    /// READ, and the connection, with [`Error::Operation`].
    pub fn read<S: Scatter + ?Sized>(&self, local: &mut S, remote: &RemoteBuf, offset: u64) -> Result<()> {
        self.run_borrowed(Action::Read { remote, offset }, self.local_sges(&*local)?).map(|_| ())
    }

    /// SEND of all of `local` — one buffer, or a gather list sent as one message, the
    /// concatenation of its parts ([`Gather`]) — (the peer must post a receive:
    /// [`Connection::recv`]). Small messages (up to
    /// [`QpOptions::max_inline`](crate::transfer::QpOptions::max_inline) bytes in all) go inline.
    ///
    /// # Errors
    /// As [`Connection::write`] (no remote range); the SEND fails with [`Error::Operation`]
    /// if the peer's receive is too small.
    pub fn send<G: Gather + ?Sized>(&self, local: &G) -> Result<()> {
        self.run_borrowed(Action::Send { imm: None }, self.local_sges(local)?).map(|_| ())
    }

    /// SEND with immediate data.
    ///
    /// # Errors
    /// As [`Connection::send`].
    pub fn send_with_imm<G: Gather + ?Sized>(&self, local: &G, imm: u32) -> Result<()> {
        self.run_borrowed(Action::Send { imm: Some(imm) }, self.local_sges(local)?).map(|_| ())
    }

    /// Posts a receive into `local` — one buffer, or a scatter list filled in order
    /// ([`Scatter`]; at most `qp().caps().max_recv_sge` parts) — and waits for the message that
    /// consumes it. What arrived: a SEND's bytes (at most the posted length,
    /// [`Arrival::Data`](crate::transfer::Arrival)), or,
    /// when the peer's WRITE with immediate consumed the receive, only its immediate
    /// ([`Arrival::ImmediateOnly`](crate::transfer::Arrival), `len` 0: no byte of `local` was
    /// written).
    ///
    /// A message whose SEND completed at the peer has arrived here: a peer that sends a last
    /// message and then closes or exits does not lose it (its completion is reaped before the
    /// close's flush; only receives still empty then fail with [`Error::Disconnected`]).
    ///
    /// # Errors
    /// - As [`Connection::write`] for `local` and the wait (no remote range, no send-queue
    ///   room to wait for).
    /// - [`Error::InvalidArgument`] if `qp.recv_depth` receives are already posted,
    ///   [`Error::Verbs`] if the device refuses the receive: nothing is posted.
    /// - Waits as long as the peer is silent, unless
    ///   [`WaitOptions::recv_timeout`](crate::transfer::WaitOptions::recv_timeout) is set: then
    ///   [`Error::Timeout`] if no SEND arrives in time (the connection is failed).
    /// - [`Error::Disconnected`] if the connection is found dead meanwhile (the peer closed it or
    ///   exited, its RDMA CM disconnected, the port went down).
    pub fn recv<S: Scatter + ?Sized>(&self, local: &mut S) -> Result<Received> {
        self.run_borrowed(Action::Recv, self.local_sges(&*local)?)
    }

    /// Posts a zero-length receive and waits for the peer's WRITE with immediate (or an empty
    /// SEND with immediate); returns the immediate.
    ///
    /// # Errors
    /// - As [`Connection::recv`] (there is no local memory to check).
    /// - [`Error::Protocol`] if a SEND without an immediate arrives (a SEND with bytes fails the
    ///   receive, and the connection, with [`Error::Operation`]).
    /// - [`Error::FlushLost`] if the device never flushes the receive after a failure.
    pub fn recv_imm(&self) -> Result<u32> {
        immediate_of(self.run_borrowed(Action::RecvImm, SgeList::Empty)?)
    }

    fn atomic(&self, action: Action<'_>) -> Result<u64> {
        self.check()?; // before the lock (a fork()ed child: Forked)
        let scratch = self.scratch().lock();
        let sge = scratch.sge(0..8)?;
        self.run_borrowed(action, SgeList::One(sge))?;
        Ok(u64::from_ne_bytes(scratch[..8].try_into().expect("8 bytes")))
    }

    /// Atomically adds `add` to the 64-bit word at `offset` in `remote`; returns its old value.
    ///
    /// # Errors
    /// - [`Error::OutOfBounds`] if the 8-byte word at `offset` is not inside `remote`;
    ///   [`Error::InvalidArgument`] if it is not 8-byte aligned.
    /// - Otherwise as [`Connection::write`]; the peer must grant `REMOTE_ATOMIC`
    ///   ([`Error::NotGranted`] before posting if it does not).
    pub fn fetch_add(&self, remote: &RemoteBuf, offset: u64, add: u64) -> Result<u64> {
        self.atomic(Action::FetchAdd { remote, offset, add })
    }

    /// Atomically replaces the 64-bit word at `offset` with `swap` if it equals `compare`;
    /// returns its old value (equal to `compare` when the swap happened).
    ///
    /// # Errors
    /// As [`Connection::fetch_add`].
    pub fn compare_swap(&self, remote: &RemoteBuf, offset: u64, compare: u64, swap: u64) -> Result<u64> {
        self.atomic(Action::CompareSwap { remote, offset, compare, swap })
    }

    /// `local` (one buffer or a list of parts) as a request's memory: checked against the
    /// connection first (its failure, a fork()ed child), then registered in
    /// [`Connection::pd`].
    pub(crate) fn local_sges<P: Parts + ?Sized>(&self, local: &P) -> Result<SgeList> {
        self.check()?;
        local.sge_list(self.pd())
    }
}
