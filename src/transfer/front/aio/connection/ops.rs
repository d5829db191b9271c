//! An [`AsyncConnection`]'s operations: each checks and posts its request at the call and returns
//! a future that gives the owned buffer back with the outcome.

use std::future::Future;

use crate::error::Result;
use crate::remote::RemoteBuf;
use crate::transfer::front::aio::op::{BufferBack, Delivered, NoBytes, Op, TargetBack};
use crate::transfer::front::aio::AsyncConnection;
use crate::transfer::front::ops::immediate_of;
use crate::transfer::request::owned::{OwnedGather, OwnedScatter};
use crate::transfer::request::received::Posted;
use crate::transfer::request::{Action, SgeList};
use crate::transfer::{Received, Rejected};
#[cfg(doc)]
use crate::{
    error::Error,
    transfer::{IoBuf, IoTarget},
};

impl AsyncConnection {
    /// Checks `action` on `sges` (`buf`'s memory, or why it has none) and starts it on `buf`;
    /// a refusal finishes the future at once. Also returns what the completion is interpreted
    /// against.
    #[inline(always)]
    fn start<B: Send + 'static>(&self, buf: B, sges: Result<SgeList>, action: Action<'_>) -> (Op<B>, Posted) {
        match sges.and_then(|sges| self.conn().request(action, sges)) {
            Ok(req) => {
                let posted = req.posted();
                (Op::start(self.shared.clone(), buf, req), posted)
            }
            Err(e) => (Op::refused(self.shared.clone(), buf, e), Posted::Send(0)),
        }
    }

    /// RDMA WRITE of all of `buf` — one owned buffer ([`IoBuf`]), or a gather list of them
    /// (`Vec<B>`, `[B; N]`) written as the concatenation of its parts — to `offset` in
    /// `remote`; gives the buffer (the whole list) back.
    ///
    /// # Errors
    /// The buffer (all of a list) comes back in [`Rejected`] with:
    /// - not posted, untouched: [`Error::NotRegistered`] (a part not registered in this
    ///   connection's PD), [`Error::OutOfBounds`] (the range does not fit in `remote`),
    ///   [`Error::NotGranted`] (the peer does not grant `REMOTE_WRITE` — `REMOTE_READ` for a
    ///   READ —, see [`AsyncConnection::peer_grants`]),
    ///   [`Error::InvalidArgument`] (an empty buffer or part, no parts, more parts than the
    ///   queue pair's scatter/gather entries, over 4 GiB - 1 bytes in all), the
    ///   connection's failure, at the call or while waiting for room ([`Error::Operation`],
    ///   [`Error::Verbs`], [`Error::Closed`]), or [`Error::Verbs`] if the device refuses the post;
    /// - [`Error::Operation`] if the WRITE failed, or was flushed after another failure
    ///   ([`Error::Closed`] after a close); [`Error::Verbs`] if polling the CQ failed. These fail
    ///   the connection; the future finishes once the flush is reaped (no timeout).
    pub fn write<B: OwnedGather>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Write { remote, offset, imm: None }).0)
    }

    /// RDMA WRITE that also delivers `imm` to the peer (consuming one of its receives).
    ///
    /// # Errors
    /// As [`AsyncConnection::write`].
    pub fn write_with_imm<B: OwnedGather>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Write { remote, offset, imm: Some(imm) }).0)
    }

    /// RDMA READ filling all of `buf` — one owned target ([`IoTarget`]), or a scatter list of
    /// them (`Vec<B>`, `[B; N]`) filled in order — from `offset` in `remote`; gives the buffer
    /// back. The target may be uninitialised memory ([`crate::heap::UninitBuffer`]): once the future
    /// returns it `Ok`, all of it is initialised.
    ///
    /// # Errors
    /// As [`AsyncConnection::write`].
    pub fn read<B: OwnedScatter>(
        &self,
        mut buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().target_sges(&mut buf);
        let (op, posted) = self.start(buf, sges, Action::Read { remote, offset });
        TargetBack(Delivered::new(op, posted))
    }

    /// SEND of all of `buf` — one owned buffer, or a gather list of them sent as one message —
    /// (the peer must have a receive posted).
    ///
    /// # Errors
    /// As [`AsyncConnection::write`] (no remote range).
    pub fn send<B: OwnedGather>(
        &self,
        buf: B,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Send { imm: None }).0)
    }

    /// SEND with immediate data.
    ///
    /// # Errors
    /// As [`AsyncConnection::send`].
    pub fn send_with_imm<B: OwnedGather>(
        &self,
        buf: B,
        imm: u32,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Send { imm: Some(imm) }).0)
    }

    /// Posts `buf` as a receive (at call time) — one owned target, or a scatter list of them
    /// (`Vec<B>`, `[B; N]`) filled in order, [`Received::len`] counting the bytes of all parts —
    /// and completes when the peer's SEND fills it, or
    /// when its RDMA WRITE with immediate consumes it (nothing written into `buf`:
    /// [`Arrival::ImmediateOnly`](crate::transfer::Arrival), `len` 0). Receives
    /// complete in the order they were posted. The buffer may be uninitialised memory
    /// ([`crate::heap::UninitBuffer`]): once the future returns it `Ok`, the bytes that arrived
    /// are initialised.
    ///
    /// # Errors
    /// As [`AsyncConnection::write`] (no remote range); [`Error::InvalidArgument`] when the
    /// receive queue is full.
    pub fn recv<B: OwnedScatter>(
        &self,
        mut buf: B,
    ) -> impl Future<Output = std::result::Result<(B, Received), Rejected<B>>> + Send + 'static {
        let sges = self.conn().target_sges(&mut buf);
        let (op, posted) = self.start(buf, sges, Action::Recv);
        Delivered::new(op, posted)
    }

    /// Posts a receive without memory and completes with the immediate of the peer's WRITE with
    /// immediate (or empty SEND with immediate).
    ///
    /// # Errors
    /// As [`AsyncConnection::recv`]; [`Error::Protocol`] if the peer sent an empty SEND without
    /// an immediate (a SEND with bytes fails the receive: it has no room).
    pub fn recv_imm(&self) -> impl Future<Output = Result<u32>> + Send + 'static {
        let (op, posted) = self.start(NoBytes, Ok(SgeList::Empty), Action::RecvImm);
        async move {
            let (_, got) = op.await.map_err(|r| r.error)?;
            immediate_of(got.delivered(posted)?)
        }
    }

    fn atomic(&self, action: Action<'_>) -> impl Future<Output = Result<u64>> + Send + 'static {
        let started = self.shared.words.take().map(|word| {
            let sges = self.conn().owned_sges(&word);
            self.start(word, sges, action).0
        });
        async move {
            let (word, _) = started?.await.map_err(|r| r.error)?;
            Ok(word.value())
        }
    }

    /// Atomically adds `add` to the 64-bit word at `offset` in `remote`; returns its old value.
    ///
    /// # Errors
    /// No buffer is involved (the landing word is the connection's):
    /// - [`Error::OutOfBounds`] if the 8-byte word at `offset` is not inside `remote`;
    ///   [`Error::InvalidArgument`] if it is not 8-byte aligned;
    /// - [`Error::Io`] or [`Error::Verbs`] if a new page of landing words cannot be mapped or
    ///   registered;
    /// - otherwise as [`AsyncConnection::write`] (the peer must grant `REMOTE_ATOMIC`).
    pub fn fetch_add(
        &self,
        remote: &RemoteBuf,
        offset: u64,
        add: u64,
    ) -> impl Future<Output = Result<u64>> + Send + 'static {
        self.atomic(Action::FetchAdd { remote, offset, add })
    }

    /// Atomically replaces the 64-bit word at `offset` with `swap` if it equals `compare`;
    /// returns its old value (equal to `compare` when the swap happened).
    ///
    /// # Errors
    /// As [`AsyncConnection::fetch_add`].
    pub fn compare_swap(
        &self,
        remote: &RemoteBuf,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> impl Future<Output = Result<u64>> + Send + 'static {
        self.atomic(Action::CompareSwap { remote, offset, compare, swap })
    }
}
