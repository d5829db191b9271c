//! `AsyncConnection`: the operations of a connection as futures over owned buffers.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;

use crate::error::{Error, Result};
use crate::transfer::engine::completion::Failure;
use crate::transfer::front::aio::wire::Msg;
use crate::transfer::front::aio::Shared;
use crate::transfer::{Connection, Options};
#[cfg(doc)]
use crate::transfer::{IoBuf, IoTarget, Rejected};
use crate::verbs::{Endpoint, Pd};

mod connect;
mod ops;

pub(crate) use connect::{async_options, blocking};

/// A reliable connection whose operations are futures (feature `tokio`). Cheap to clone: clones
/// share the connection, which closes when the last clone and the last operation are gone.
///
/// Every operation takes its local buffer **by value** ([`IoBuf`] / [`IoTarget`]) and gives it
/// back with the result, as tokio-uring does, so a buffer moves into a task and out again. A
/// WRITE's or SEND's source may be a gather list of owned buffers (`Vec<B>`, `[B; N]`), a READ's
/// or receive's target a scatter list filled in order: one request, several entries, the whole
/// list back.
///
/// ```no_run
/// # async fn f(pd: &mralloc::verbs::Pd, heap: &mralloc::Heap) -> Result<(), Box<dyn std::error::Error>> {
/// use mralloc::transfer::{AsyncConnection, Options};
/// let conn = AsyncConnection::connect("10.0.0.2:7471", pd, Options::default()).await?;
/// let remote = mralloc::RemoteBuf::from_bytes(conn.peer_blob())?;
/// let mut buf = heap.alloc(1 << 20)?;
/// buf.fill(7);
/// let buf = conn.write(buf, &remote, 0).await?; // the buffer comes back
/// let (buf, got) = conn.recv(buf).await?;
/// println!("the peer sent {} bytes", got.len);
/// let [header, buf] = conn.send([heap.alloc(16)?, buf]).await?; // one SEND, two entries
/// # drop((header, buf)); Ok(()) }
/// ```
///
/// - **Posting** happens when the operation is called; a full send queue makes the future wait
///   (not the thread) for room.
/// - **Waiting**: a future first polls the CQ for a short, adaptive time
///   ([`WaitOptions::spin`](crate::transfer::WaitOptions::spin)), then sleeps; a driver task per connection sleeps on the
///   completion channel through tokio's reactor and wakes it. Nothing blocks an executor
///   thread: the TCP setup exchange runs as async code on the runtime (creating a queue pair
///   is a short kernel call; connecting it, which on RoCE may wait for the peer's address to
///   resolve, runs on tokio's blocking pool); RDMA CM setup runs on tokio's blocking pool.
/// - **Cancel-safe**: dropping a future (a cancelled task, `tokio::time::timeout`, a `select!`
///   branch not taken) never frees memory the NIC may touch. Its buffer is parked with the
///   connection and freed when the completion, or the flush after a failure or close, is
///   reaped. A dropped receive stays posted: the next SEND lands in it and is discarded.
/// - **Failures** are the blocking API's: the first failed completion fails the connection (its
///   queue pair goes to the error state) and every later operation returns that error at once.
///   There is no per-operation timeout
///   ([`WaitOptions::op_timeout`](crate::transfer::WaitOptions::op_timeout) is for blocking calls):
///   wrap a future in `tokio::time::timeout`, which is safe (see above).
///
/// The runtime needs I/O enabled (`enable_io` or `enable_all`). Dropping the last handle
/// closes the connection; if requests are still outstanding, the close runs on the blocking
/// pool.
#[derive(Clone)]
pub struct AsyncConnection {
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for AsyncConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AsyncConnection").field(self.shared.conn()).finish()
    }
}

impl AsyncConnection {
    pub(crate) fn conn(&self) -> &Connection {
        self.shared.conn()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The PD local memory must be registered in.
    pub fn pd(&self) -> &Pd {
        self.conn().pd()
    }

    /// The peer's endpoint.
    pub fn peer(&self) -> &Endpoint {
        self.conn().peer()
    }

    /// The peer's buffer `desc` as reached over this connection (see
    /// [`crate::transfer::Connection::remote_of`]).
    ///
    /// # Errors
    /// [`Error::NoKeyForDevice`] if `desc` has no key for the peer's device at this connection.
    pub fn remote_of(&self, desc: &crate::RemoteDesc) -> crate::Result<crate::RemoteBuf> {
        self.conn().remote_of(desc)
    }

    /// The blob the peer sent while connecting; empty if none.
    pub fn peer_blob(&self) -> &[u8] {
        self.conn().peer_blob()
    }

    /// What the peer lets this side do into its memory through the connection (see
    /// [`crate::transfer::Connection::peer_grants`]): a WRITE, READ or atomic it does not grant
    /// is refused before it is posted, with [`Error::NotGranted`] (the buffer comes back in
    /// [`Rejected`]).
    pub fn peer_grants(&self) -> crate::verbs::Access {
        self.conn().peer_grants()
    }

    /// The options in force.
    pub fn options(&self) -> &Options {
        self.conn().options()
    }

    /// The peer's IP address and port (see [`Connection::peer_addr`]).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.conn().peer_addr()
    }

    /// The error that failed the connection, if any.
    pub fn error(&self) -> Option<Error> {
        self.conn().error()
    }

    /// A snapshot of the connection's counters (see [`crate::transfer::Connection::stats`]).
    pub fn stats(&self) -> crate::transfer::ConnectionStats {
        self.conn().stats()
    }

    /// Closes the connection: later operations fail with [`Error::Closed`]; completes once the
    /// device has flushed every outstanding request (and the buffers of dropped operations are
    /// freed). Operations still awaited complete with the flush error and give their buffers
    /// back.
    ///
    /// # Errors
    /// [`Error::Verbs`] if moving the queue pair to the error state failed (nothing is flushed
    /// then; the connection keeps what it holds until it is dropped). The flush is awaited
    /// without a deadline: unlike [`Connection::close`] there is no [`Error::FlushLost`].
    pub async fn close(&self) -> Result<()> {
        let conn = self.conn();
        if let Some(cs) = &self.shared.control {
            // The peer frees what it lent at once rather than at its next keepalive.
            let _ = cs.tell(Msg::Bye);
        }
        conn.fail(Failure::Closed);
        conn.qp().set_error()?;
        poll_fn(|cx| {
            self.shared.waiters.register(cx.waker());
            let _ = conn.core().drain();
            // Requests still waiting for room are refused now (the connection is closed).
            self.shared.pump();
            if conn.core().quiet() {
                // Nothing reaches lent memory through a flushed queue pair in the error state.
                if let Some(cs) = &self.shared.control {
                    drop(cs.take_lent());
                }
                Poll::Ready(Ok(()))
            } else {
                if !self.shared.driver_alive.load(std::sync::atomic::Ordering::Acquire) {
                    // No driver to wake us (its runtime is gone): poll again soon.
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            }
        })
        .await
    }
}
