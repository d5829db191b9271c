//! Remote memory over an async rail group: memory of one side's heap lent to the other through
//! every rail at once, with a key per rail in one descriptor (see [`RailsRemoteMemory`]).

use std::future::Future;

use crate::error::Result;
use crate::heap::{Buffer, Heap};
use crate::transfer::rails::aio::AsyncRails;
use crate::transfer::{RailsRemoteMemory, Rejected, RemoteLimits};
use crate::verbs::Access;
#[cfg(doc)]
use crate::{error::Error, transfer::AsyncConnection};

impl AsyncRails {
    /// Lends the peer memory of `heap` when it asks ([`AsyncRails::request_remote`]), within
    /// `limits` on each rail: each grant is a zeroed buffer of exactly the size asked for, with a
    /// key per live rail for exactly those bytes (a memory window bound through that rail's
    /// connection, as [`AsyncConnection::serve_remote_memory`]'s), all in one
    /// [`crate::RemoteDesc`]. `heap` must be built with [`Access::MW_BIND`] and bound to every
    /// rail's protection domain. Calling it again replaces the heap and limits for later
    /// requests; until it is called, requests are refused
    /// ([`crate::RemoteRefusal::NotServing`]).
    ///
    /// Each key lives as long as its rail: a rail that fails frees its key once its queue
    /// pair is flushed, the others keep theirs; the buffer is freed when the peer drops its
    /// handle (or every rail is gone).
    ///
    /// # Errors
    /// [`Error::NoControlChannel`] if a rail has none (the peer's end is not async);
    /// [`Error::InvalidArgument`] if `heap` was not built with [`Access::MW_BIND`] or is not
    /// bound to a rail's PD.
    pub fn serve_remote_memory(&self, heap: &Heap, limits: RemoteLimits) -> Result<()> {
        self.lending.set_serving(heap, limits)
    }

    /// Asks the peer for `len` bytes of its heap with `access` (remote read and/or write),
    /// reachable through every rail: the handle's [`RailsRemoteMemory::desc`] carries a key per
    /// rail, for this group's striped transfers. The memory is zeroed, exactly `len` bytes, and
    /// freed at the peer when the handle is dropped. The request goes on the first live rail.
    /// Cancelling the future is safe: a grant that arrives afterwards is given back at once.
    ///
    /// # Errors
    /// [`Error::RemoteRefused`] with the peer's reason and limit (a rail's limits, or the
    /// rights a rail's queue pair does not admit); [`Error::NoControlChannel`] if the first
    /// live rail has none; [`Error::InvalidArgument`] for 0 bytes or rights other than remote
    /// read/write; [`Error::RailsDown`] if no rail lives; the request rail's failure (or
    /// [`Error::Closed`]) if it fails before the answer; [`Error::Protocol`] if the answer has
    /// a key for no rail of this group.
    pub fn request_remote(
        &self,
        len: u64,
        access: Access,
    ) -> impl Future<Output = Result<RailsRemoteMemory>> + Send + 'static {
        self.lending.request(len, access)
    }

    /// Pushes `buf` to the peer through every live rail: a key per rail for exactly its bytes
    /// with `access` (remote read and/or write), told to the peer with `tag` on the first live
    /// rail; the peer gets a [`RailsRemoteMemory`] from [`AsyncRails::pushed`]. This side keeps
    /// the buffer until the peer drops the handle (then it is freed) or every rail is gone.
    /// The buffer must come from a heap built with [`Access::MW_BIND`], bound to every rail's
    /// protection domain.
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`] (every key made is withdrawn first):
    /// - [`Error::RailsDown`] if no rail lives (or every one failed under its bind);
    /// - [`Error::InvalidArgument`]: rights other than remote read/write or beyond a live
    ///   rail's [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access), more
    ///   live rails than a descriptor has keys, two rails whose ends present one GID, a heap
    ///   without [`Access::MW_BIND`]; [`Error::NotRegistered`] (not memory of a heap bound to a
    ///   rail's PD); [`Error::Verbs`] (allocating a window, or an exact registration);
    /// - a window bind's failure, as [`AsyncConnection::write`] (it fails that rail);
    /// - [`Error::Closed`] if the peer could not be told.
    ///
    /// `buf` is `None` if a key could not be shown dead (its rail's connection keeps the
    /// buffer until it goes), or with [`Error::FlushLost`] (kept until that connection is
    /// dropped).
    pub async fn push(&self, buf: Buffer, access: Access, tag: u64) -> std::result::Result<(), Rejected<Buffer>> {
        self.lending.push(buf, access, tag).await
    }

    /// The next memory the peer pushed over the group ([`AsyncRails::push`]), with its tag.
    ///
    /// # Errors
    /// [`Error::RailsDown`] once no rail lives and nothing pushed is waiting.
    pub async fn pushed(&self) -> Result<(u64, RailsRemoteMemory)> {
        self.lending.pushed().await
    }
}
