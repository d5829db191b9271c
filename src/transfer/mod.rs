//! Connections and zero-copy RDMA operations on heap memory and mapped files.
//!
//! - Setup: [`Listener`] / [`Connection::connect`] exchange endpoints (and an optional blob, e.g.
//!   an encoded [`crate::RemoteBuf`]) over TCP with a small versioned message, optionally
//!   authenticated by a shared [`Secret`] ([`SetupOptions::secret`]);
//!   [`CmListener`] / [`Connection::connect_cm`] do the same through the RDMA connection manager;
//!   [`Connection::pair`] connects two QPs of one process (loopback).
//! - Blocking operations borrow local memory for the call ([`Local`]): [`Connection::write`],
//!   `read`, `send`, `recv`, `write_with_imm`/`recv_imm`, `fetch_add`, `compare_swap`. They do not
//!   return while the NIC may touch the memory. Every front end names a remote range the same
//!   way — `(local, remote, offset)` — and every request's local side may be a
//!   gather/scatter list of buffers: one request, several entries (borrowed for blocking and
//!   batched requests, [`Gather`] / [`Scatter`]; owned for the others, [`OwnedGather`] /
//!   [`OwnedScatter`], below).
//! - Non-blocking operations own it ([`IoBuf`], [`IoBufMut`]; sub-ranges as [`Slice`]; a list
//!   as `Vec<B>` or `[B; N]` of them):
//!   [`Connection::post_write`] and friends return a [`Pending`] that keeps the buffer until its
//!   completion is reaped. Dropping it parks the buffer with the connection; forgetting it leaks
//!   the buffer. References are not accepted, so safe code cannot free memory the NIC may touch.
//! - [`Batch`]: many requests, few doorbells, selective signaling.
//! - Completions: a short adaptive poll, then sleep on the completion channel
//!   ([`WaitMode::Event`], the default: an idle wait costs no CPU), pure busy polling
//!   ([`WaitMode::BusyPoll`], for latency on dedicated cores), or a [`Poller`] thread serving
//!   many connections.
//! - Async (feature `tokio`): `AsyncConnection`, `AsyncListener` and `AsyncCmListener`, the same operations as
//!   futures over owned buffers, which give the buffer back with the result; cancelling a
//!   future never frees memory the NIC may touch.
//! - [`Rails`]: one connection per device pair to a peer, used as one — striped WRITEs and
//!   READs spread by bytes in flight, lists of (buffer, remote range) pieces as one transfer,
//!   failover of a dead rail's slices to the live ones (`AsyncRails` with `tokio`).
//! - [`MappedFile`]: files mapped and registered for zero-copy transfer.
//! - [`Connection::grant`]: a revocable rkey for exactly one buffer, working through that
//!   connection only (a type 2 memory window, over a registration of just the buffer on devices
//!   that do not confine windows).
//! - Remote rights: a connection lets its peer RDMA WRITE, READ or use atomics on this side's
//!   memory only if [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access) asks for it (default: none; SENDs always work).
//!   The setup carries each side's rights to the other ([`Connection::peer_grants`]): a request
//!   the peer did not grant is refused before it is posted ([`crate::Error::NotGranted`]).
//!
//! Local memory is anything [`Local`]: heap [`crate::Buffer`]s, slices of any heap memory (keys
//! from [`crate::keys_of`]), [`crate::verbs::RegisteredBuf`]s and mapped files; foreign memory is
//! a typed error ([`crate::Error::NotRegistered`]) before anything is posted. Remote ranges are
//! bounds-checked locally. A failed completion fails the connection: later posts return the
//! original error at once.

mod connection;
mod engine;
mod exact;
#[cfg(test)]
mod exact_tests;
#[cfg(test)]
mod fault_tests;
mod front;
mod grant;
mod liveness;
mod mapped;
mod options;
mod rails;
mod request;
mod setup;
mod shared_recv;

pub use connection::Connection;
pub use engine::completion::Completed;
pub use engine::poller::Poller;
pub use engine::stats::ConnectionStats;
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub use front::aio::{
    AsyncCmListener, AsyncConnection, AsyncListener, RailsRemoteMemory, RemoteLimits, RemoteMemory, RemoteMemoryStats,
};
pub use front::batch::Batch;
pub use front::pending::Pending;
pub use grant::Grant;
pub use mapped::{MappedFile, MappedSlice, Mode};
pub use options::{DeviceChoice, Options, QpOptions, SetupOptions, WaitMode, WaitOptions};
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub use rails::{AsyncRails, AsyncRailsListener, StripedOp};
pub use rails::{Finished, RailInfo, RailOptions, RailReport, Rails, RailsGrant, RailsListener, Striped, MAX_RAILS};
pub use request::iobuf::{IoBuf, IoBufMut, IoTarget, Rejected, Slice};
pub use request::local::{Local, LocalMut};
pub use request::owned::{OwnedGather, OwnedScatter};
pub use request::parts::{Gather, Scatter};
pub use request::received::{Arrival, Received};
pub use setup::acceptor::HandshakeFailure;
pub use setup::auth::Secret;
pub use setup::cm::{CmListener, MAX_ASYNC_CM_ACCEPT_BLOB, MAX_ASYNC_CM_BLOB, MAX_CM_ACCEPT_BLOB, MAX_CM_BLOB};
pub use setup::exchange::MAX_BLOB;
pub use setup::tcp::Listener;
pub use shared_recv::{SharedMessage, SharedReceiver};
