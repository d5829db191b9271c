//! Blocking operations: post, wait for the completion, return. The local memory is borrowed for
//! the call, which does not return while the NIC may still touch it.

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::local::{sge_of, Local, LocalMut, Sges};
use crate::transfer::received::{Posted, Received};
use crate::transfer::{Completed, Connection};
use crate::verbs::{RemoteAddr, SendFlags, SendOp, Sge, Verb};

/// The immediate a receive of no bytes (posted by `recv_imm`) delivered, or why there is none.
pub(crate) fn immediate_of(got: Completed) -> Result<u32> {
    let r = got.delivered(Posted::Recv(0))?;
    r.imm.ok_or_else(|| Error::Protocol("expected an immediate, got an empty SEND without one".into()))
}

/// The remote word an atomic (`verb`) targets: in bounds and 8-byte aligned.
pub(crate) fn atomic_target(verb: Verb, remote: &RemoteBuf, offset: u64) -> Result<RemoteAddr> {
    let to = remote.at(offset, 8)?;
    if to.addr % 8 != 0 {
        return Err(Error::InvalidArgument(format!("{verb} needs an 8-byte-aligned remote word, got {:#x}", to.addr)));
    }
    Ok(to)
}

pub(crate) fn nonempty(len: usize, verb: Verb) -> Result<()> {
    if len == 0 {
        return Err(Error::InvalidArgument(format!("{verb} of zero bytes")));
    }
    Ok(())
}

impl Connection {
    pub(crate) fn one(&self, sge: Sge, what: SendOp) -> Result<Completed> {
        let flags = self.inline_flag(&what, sge.len() as usize);
        self.post_and_wait_borrowed(Sges::PerRequest(&[sge]), &[what], flags)
    }

    /// `INLINE` for an operation that carries a payload (SEND, WRITE, with or without immediate)
    /// of at most [`Options::max_inline`](crate::transfer::Options::max_inline) bytes: the bytes
    /// are copied into the work request at post time. Every single-request post decides here.
    pub(crate) fn inline_flag(&self, what: &SendOp, len: usize) -> SendFlags {
        let payload =
            matches!(what, SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write(_) | SendOp::WriteWithImm(..));
        if payload && len <= self.options().max_inline as usize {
            SendFlags::INLINE
        } else {
            SendFlags::NONE
        }
    }

    /// RDMA WRITE of all of `local` to the start of `remote`.
    ///
    /// # Errors
    /// As [`Connection::write_at`].
    pub fn write<L: Local + ?Sized>(&self, local: &L, remote: &RemoteBuf) -> Result<()> {
        self.write_at(local, remote, 0)
    }

    /// RDMA WRITE of all of `local` to `offset` bytes into `remote` (bounds-checked here).
    ///
    /// # Errors
    /// - The connection's earlier failure, at once ([`Error::Operation`], [`Error::Verbs`],
    ///   [`Error::Closed`]).
    /// - Nothing posted, the connection still usable: [`Error::InvalidArgument`] (`local` empty or
    ///   over `u32::MAX` bytes), [`Error::NotRegistered`] (`local` not registered in
    ///   [`Connection::pd`]), [`Error::OutOfBounds`] (the range does not fit in `remote`),
    ///   [`Error::Timeout`] (no send-queue room within
    ///   [`Options::op_timeout`](crate::transfer::Options::op_timeout)), [`Error::Verbs`] or
    ///   [`Error::Io`] (the post refused, or waiting for room failed).
    /// - Posted, and the connection failed: [`Error::Operation`] (a failed completion, e.g.
    ///   `REM_ACCESS_ERR` when the peer's key, range or
    ///   [`Options::remote_access`](crate::transfer::Options::remote_access) does not allow it),
    ///   [`Error::Timeout`] (no completion within `op_timeout`), [`Error::Verbs`] or [`Error::Io`]
    ///   (polling or waiting failed). It returns once the NIC is done with `local`; if the device
    ///   never flushes the request, the process aborts.
    pub fn write_at<L: Local + ?Sized>(&self, local: &L, remote: &RemoteBuf, offset: u64) -> Result<()> {
        let sge = self.checked(local, Verb::Write)?;
        let to = remote.at(offset, sge.len().into())?;
        self.one(sge, SendOp::Write(to)).map(|_| ())
    }

    /// RDMA WRITE that also delivers `imm` to the peer. It consumes one of the peer's posted
    /// receives ([`Connection::recv_imm`], or any `recv`/`post_recv`: that receive's buffer is
    /// left untouched and reports [`Arrival::ImmediateOnly`](crate::transfer::Arrival)); the
    /// WRITE's bytes are in the target once that receive completes.
    ///
    /// # Errors
    /// As [`Connection::write_at`] (the peer must have a receive posted).
    pub fn write_with_imm<L: Local + ?Sized>(
        &self,
        local: &L,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> Result<()> {
        let sge = self.checked(local, Verb::WriteWithImm)?;
        let to = remote.at(offset, sge.len().into())?;
        self.one(sge, SendOp::WriteWithImm(to, imm)).map(|_| ())
    }

    /// RDMA READ of `local.len()` bytes from the start of `remote` into `local`.
    ///
    /// # Errors
    /// As [`Connection::read_at`].
    pub fn read<L: LocalMut + ?Sized>(&self, local: &mut L, remote: &RemoteBuf) -> Result<()> {
        self.read_at(local, remote, 0)
    }

    /// RDMA READ of `local.len()` bytes from `offset` bytes into `remote`.
    ///
    /// # Errors
    /// As [`Connection::write_at`] (the peer must allow `REMOTE_READ`). Memory registered
    /// without `LOCAL_WRITE` (a read-only [`MappedFile`](crate::transfer::MappedFile)) fails the
    /// READ, and the connection, with [`Error::Operation`].
    pub fn read_at<L: LocalMut + ?Sized>(&self, local: &mut L, remote: &RemoteBuf, offset: u64) -> Result<()> {
        let sge = self.checked(&*local, Verb::Read)?;
        let from = remote.at(offset, sge.len().into())?;
        self.one(sge, SendOp::Read(from)).map(|_| ())
    }

    /// SEND of all of `local` (the peer must post a receive: [`Connection::recv`]).
    ///
    /// # Errors
    /// As [`Connection::write_at`] (no remote range); the SEND fails with [`Error::Operation`]
    /// if the peer's receive is too small.
    pub fn send<L: Local + ?Sized>(&self, local: &L) -> Result<()> {
        let sge = self.checked(local, Verb::Send)?;
        self.one(sge, SendOp::Send).map(|_| ())
    }

    /// SEND with immediate data.
    ///
    /// # Errors
    /// As [`Connection::send`].
    pub fn send_with_imm<L: Local + ?Sized>(&self, local: &L, imm: u32) -> Result<()> {
        let sge = self.checked(local, Verb::SendWithImm)?;
        self.one(sge, SendOp::SendWithImm(imm)).map(|_| ())
    }

    /// Posts a receive into `local` and waits for the message that consumes it. What arrived:
    /// a SEND's bytes (at most `local.len()`, [`Arrival::Data`](crate::transfer::Arrival)), or,
    /// when the peer's WRITE with immediate consumed the receive, only its immediate
    /// ([`Arrival::ImmediateOnly`](crate::transfer::Arrival), `len` 0: no byte of `local` was
    /// written).
    ///
    /// A message whose SEND completed at the peer has arrived here: a peer that sends a last
    /// message and then closes or exits does not lose it (its completion is reaped before the
    /// close's flush; only receives still empty then fail with [`Error::Disconnected`]).
    ///
    /// # Errors
    /// - As [`Connection::write_at`] for `local` and the wait (no remote range, no send-queue
    ///   room to wait for).
    /// - [`Error::InvalidArgument`] if `recv_depth` receives are already posted, [`Error::Verbs`]
    ///   if the device refuses the receive: nothing is posted.
    /// - Waits as long as the peer is silent, unless
    ///   [`Options::recv_timeout`](crate::transfer::Options::recv_timeout) is set: then
    ///   [`Error::Timeout`] if no SEND arrives in time (the connection is failed).
    /// - [`Error::Disconnected`] if the connection is found dead meanwhile (the peer closed it or
    ///   exited, its RDMA CM disconnected, the port went down).
    pub fn recv<L: LocalMut + ?Sized>(&self, local: &mut L) -> Result<Received> {
        let sge = self.checked(&*local, Verb::Recv)?;
        // SAFETY: `local` is exclusively borrowed until the receive is claimed below (wait fails
        // the QP and waits for the flush on any error; FlushLost aborts; unwinding waits too).
        let t = unsafe { self.post_recv_raw(std::slice::from_ref(&sge))? };
        self.wait_borrowed(t)?.delivered(Posted::Recv(sge.len() as usize))
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
        // SAFETY: a receive without memory.
        let t = unsafe { self.post_recv_raw(&[])? };
        immediate_of(self.wait(t)?)
    }

    fn atomic(
        &self,
        verb: Verb,
        remote: &RemoteBuf,
        offset: u64,
        what: impl FnOnce(RemoteAddr) -> SendOp,
    ) -> Result<u64> {
        let to = atomic_target(verb, remote, offset)?;
        self.check()?; // before the lock (a fork()ed child: Forked)
        let scratch = self.scratch().lock();
        let sge = scratch.sge(0..8)?;
        self.one(sge, what(to))?;
        Ok(u64::from_ne_bytes(scratch[..8].try_into().expect("8 bytes")))
    }

    /// Atomically adds `add` to the 64-bit word at `offset` in `remote`; returns its old value.
    ///
    /// # Errors
    /// - [`Error::OutOfBounds`] if the 8-byte word at `offset` is not inside `remote`;
    ///   [`Error::InvalidArgument`] if it is not 8-byte aligned.
    /// - Otherwise as [`Connection::write_at`]; the peer must grant `REMOTE_ATOMIC`.
    pub fn fetch_add(&self, remote: &RemoteBuf, offset: u64, add: u64) -> Result<u64> {
        self.atomic(Verb::FetchAdd, remote, offset, |r| SendOp::FetchAdd { remote: r, add })
    }

    /// Atomically replaces the 64-bit word at `offset` with `swap` if it equals `compare`;
    /// returns its old value (equal to `compare` when the swap happened).
    ///
    /// # Errors
    /// As [`Connection::fetch_add`].
    pub fn compare_swap(&self, remote: &RemoteBuf, offset: u64, compare: u64, swap: u64) -> Result<u64> {
        self.atomic(Verb::CompareSwap, remote, offset, |r| SendOp::CompareSwap { remote: r, compare, swap })
    }

    pub(crate) fn checked<L: Local + ?Sized>(&self, local: &L, verb: Verb) -> Result<Sge> {
        self.check()?;
        nonempty(local.local_len(), verb)?;
        sge_of(local, self.pd())
    }
}
