//! Remote memory over an async rail group: memory of one side's heap lent to the other through
//! every rail at once, with a key per rail in one descriptor (see [`RailsRemoteMemory`]).

use std::future::Future;

use crate::error::Result;
use crate::heap::{Buffer, Heap};
use crate::transfer::rails::aio::AsyncRails;
use crate::transfer::{RailsRemoteMemory, Rejected, RemoteLimits, RemoteMemoryStats};
use crate::verbs::Access;
#[cfg(doc)]
use crate::{
    error::Error,
    transfer::{AsyncConnection, AsyncRailsListener},
};

impl AsyncRails {
    /// Lends the peer memory of `heap` when it asks ([`AsyncRails::request_remote`]): each
    /// grant is a zeroed buffer of exactly the size asked for, with a key per live rail for
    /// exactly those bytes (a memory window bound through that rail's connection, as
    /// [`AsyncConnection::serve_remote_memory`]'s), all in one [`crate::RemoteDesc`]. Requests
    /// are answered in the background by the rails' control channels (a second connection per
    /// rail, set up with it: nothing to poll, and nothing on [`AsyncRails::messages`]). Calling
    /// it again replaces the heap and limits for later requests; until it is called, requests
    /// are refused ([`crate::RemoteRefusal::NotServing`]) — a server that lends from the first
    /// request on sets it on its listener ([`AsyncRailsListener::serve_remote_memory`]).
    ///
    /// `heap` needs [`Access::MW_BIND`] (the windows carry the remote rights; the heap's chunks
    /// need none) and must be bound to every rail's protection domain. The rights a peer may
    /// ask for are those every live rail's
    /// [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access) admits.
    /// `limits` apply to each rail's connection as to a single one: a grant counts its whole
    /// length against every rail it has a key on (each rail's key holds all of it), and
    /// [`RemoteLimits::max_request`] is the largest length granted.
    ///
    /// Each key lives as long as its rail: a rail that fails frees its key once its queue pair
    /// is flushed, the others keep theirs; the buffer is freed with the last key — when the
    /// peer drops its handle, or the rails go. (One case keeps a key longer: if the rail that
    /// carried a grant fails before the grant reached the peer, the keys on the other rails stay
    /// until those connections close — nobody knows them to give them back.)
    ///
    /// # Errors
    /// [`Error::NoControlChannel`] if a rail has none (the peer's end is not async);
    /// [`Error::InvalidArgument`] if `heap` was not built with [`Access::MW_BIND`] or is not
    /// bound to a rail's PD; as [`Heap::alloc`] if the one-byte allocation that checks the
    /// binding fails.
    pub fn serve_remote_memory(&self, heap: &Heap, limits: RemoteLimits) -> Result<()> {
        self.lending.set_serving(heap, limits)
    }

    /// Asks the peer for `len` bytes of its heap with `access` (remote read and/or write),
    /// reachable through every rail: the handle's [`RailsRemoteMemory::desc`] carries a key per
    /// rail, for this group's striped transfers. The memory is zeroed, exactly `len` bytes, and
    /// freed at the peer when the handle is dropped. The request goes on the first live rail's
    /// control channel. Cancelling the future is safe: a grant that arrives afterwards is given
    /// back at once.
    ///
    /// ```no_run
    /// # async fn f(rails: &mralloc::transfer::AsyncRails, heap: &mralloc::Heap) -> mralloc::Result<()> {
    /// use mralloc::verbs::Access;
    /// // The peer serves (AsyncRails::serve_remote_memory, or its listener's).
    /// let mem = rails.request_remote(64 << 20, Access::REMOTE_WRITE | Access::REMOTE_READ).await?;
    /// let mut data = heap.alloc(64 << 20)?; // a heap bound to every rail's PD
    /// data.fill(7);
    /// let done = rails.write(data, &mem.desc(), 0).await; // striped over the rails
    /// let (data, reports) = done.into_one()?;
    /// drop(mem); // the peer revokes every key and frees the memory
    /// # drop((data, reports)); Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::RemoteRefused`] with the peer's reason and limit (a rail's limits, the rights a
    /// rail's queue pair does not admit, or [`crate::RemoteRefusal::Unavailable`] if a bind
    /// failed); [`Error::InvalidArgument`] for 0 bytes or rights other than remote read/write;
    /// [`Error::RailsDown`] if no rail lives with a control channel; the request rail's failure
    /// (or [`Error::Closed`]) if it fails before the answer; [`Error::Protocol`] if the answer
    /// has a key for no rail of this group.
    pub fn request_remote(
        &self,
        len: u64,
        access: Access,
    ) -> impl Future<Output = Result<RailsRemoteMemory>> + Send + 'static {
        self.lending.request(len, access)
    }

    /// Pushes `buf` to the peer through every live rail: a key per rail for exactly its bytes
    /// with `access` (remote read and/or write), told to the peer with `tag` on the first live
    /// rail's control channel; the peer gets a [`RailsRemoteMemory`] from
    /// [`AsyncRails::pushed`]. This side keeps the buffer until the peer drops the handle (then
    /// it is freed) or the rails go. The buffer must come from a heap built with
    /// [`Access::MW_BIND`], bound to every rail's protection domain. The push runs in a task
    /// of its own: cancelling the future does not cut it short (the peer still gets the memory,
    /// or a failure frees the buffer).
    ///
    /// # Panics
    /// If the push's task panicked (the panic is passed on).
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`] (every key made is withdrawn first):
    /// - [`Error::RailsDown`] if no rail lives with a control channel (or every one failed
    ///   under its bind, or none was left to tell the peer);
    /// - [`Error::InvalidArgument`]: rights other than remote read/write or beyond a live
    ///   rail's [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access), more
    ///   live rails than a descriptor has keys, two rails whose ends present one GID, a heap
    ///   without [`Access::MW_BIND`]; [`Error::NotRegistered`] (not memory of a heap bound to a
    ///   rail's PD); [`Error::Verbs`] (allocating a window, or an exact registration);
    /// - a window bind's failure, as [`AsyncConnection::write`] (it fails that rail);
    /// - [`Error::Closed`] if the peer could not be told; [`Error::Io`] outside a tokio runtime;
    /// - [`Error::Closed`] with `buf` `None` if the runtime shut down under the push (what it
    ///   lent is freed with the connections).
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
    /// [`Error::RailsDown`] once no rail lives and nothing pushed is waiting (checked at each
    /// keepalive interval; a runtime without timers waits until something is pushed).
    pub async fn pushed(&self) -> Result<(u64, RailsRemoteMemory)> {
        self.lending.pushed().await
    }

    /// What this side lends the peer over the group and holds of it now: `lent_*` sum every
    /// live rail's registry (a buffer lent over `n` rails counts `n` times: each rail's key
    /// holds it; [`AsyncConnection::remote_memory_stats`] of a rail shows that rail's),
    /// `held_*` count this side's [`RailsRemoteMemory`] handles.
    pub fn remote_memory_stats(&self) -> RemoteMemoryStats {
        self.lending.stats()
    }
}
