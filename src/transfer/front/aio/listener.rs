//! `AsyncListener`: accepts connections without blocking an executor thread.

use std::net::SocketAddr;

use tokio::net::ToSocketAddrs;

use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::transfer::front::aio::connection::async_options;
use crate::transfer::front::aio::lending::{check_lending_heap, RemoteLimits};
use crate::transfer::setup::acceptor::{no_answer, Accepting, Reply};
use crate::transfer::{AsyncConnection, Listener, Options};
use crate::verbs::Pd;

/// Accepts RDMA connections whose endpoints arrive over TCP, as [`Listener`] does (handshakes on
/// threads of its own, several at once, each within
/// [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout)), for tokio:
/// an accept call is a future that waits for a handshake to serve. Peers connect with
/// [`AsyncConnection::connect`] or [`crate::transfer::Connection::connect`].
///
/// ```no_run
/// # async fn f(pd: &mralloc::verbs::Pd) -> mralloc::Result<()> {
/// use mralloc::transfer::{AsyncListener, Options};
/// let listener = AsyncListener::bind("0.0.0.0:7471", pd, Options::default()).await?;
/// loop {
///     let conn = listener.accept().await?;
///     tokio::spawn(async move { /* serve `conn` */ drop(conn) });
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct AsyncListener {
    listener: Listener,
    serving: Option<(Heap, RemoteLimits)>,
}

impl AsyncListener {
    /// Listens on `addr` for connections in `pd`.
    ///
    /// # Errors
    /// [`Error::Io`] if `addr` cannot be resolved or bound, or the listener's acceptor thread
    /// cannot start.
    pub async fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<AsyncListener> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(|source| Error::Io { what: "resolving the listener's address".into(), source })?
            .collect();
        let listener = Listener::bind_offering(&addrs[..], pd, &async_options(opts)?, true)?;
        Ok(AsyncListener { listener, serving: None })
    }

    /// Makes every connection accepted from now on lend its peer memory of `heap` within
    /// `limits`, from the peer's first request on (as
    /// [`AsyncConnection::serve_remote_memory`], which a connection can only be given once
    /// accepted: a request that arrives before is refused).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `heap` was not built with
    /// [`crate::verbs::Access::MW_BIND`] or is not bound to the listener's PD; as
    /// [`Heap::alloc`] if the one-byte allocation that checks the binding fails.
    pub fn serve_remote_memory(&mut self, heap: &Heap, limits: RemoteLimits) -> Result<()> {
        check_lending_heap(heap, self.listener.pd())?;
        self.serving = Some((heap.clone(), limits));
        Ok(())
    }

    /// How many client setups are running now (see [`Listener::handshakes_in_flight`]).
    pub fn handshakes_in_flight(&self) -> usize {
        self.listener.handshakes_in_flight()
    }

    /// How many clients' setups failed since the listener was bound.
    pub fn failed_handshakes(&self) -> u64 {
        self.listener.failed_handshakes()
    }

    /// The most recent failed client setups (at most 64), oldest first, taken out.
    pub fn take_handshake_failures(&self) -> Vec<crate::transfer::HandshakeFailure> {
        self.listener.take_handshake_failures()
    }

    /// The address it listens on.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot report it.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts the next connection.
    ///
    /// # Errors
    /// As [`AsyncListener::accept_with`].
    pub async fn accept(&self) -> Result<AsyncConnection> {
        self.accept_with(&[]).await
    }

    /// Accepts the next connection, sending `blob` to the peer with this side's endpoint.
    ///
    /// Cancelling the future before a handshake took its blob loses nothing (the blob is
    /// withdrawn, and the handshake waits for the next accept call). Cancelled after, while the
    /// handshake finishes, the finished connection is dropped (the peer sees it fail with
    /// [`Error::Disconnected`]).
    ///
    /// A client whose setup fails is that client's problem, as for [`Listener::accept_with`]:
    /// the future goes on waiting for the next one ([`AsyncListener::failed_handshakes`],
    /// [`AsyncListener::take_handshake_failures`]).
    ///
    /// # Errors
    /// As [`Listener::accept_with`]; [`Error::Io`] if the connection cannot be registered with
    /// the runtime's reactor.
    pub async fn accept_with(&self, blob: &[u8]) -> Result<AsyncConnection> {
        let accepting = self.listener.accepting();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let id = accepting.offer(blob.to_vec(), Reply::Async(tx));
        // Cancelled before a handshake took the offer: take it back (after, the handshake's
        // connection is dropped with the answer nobody reads).
        struct Withdraw<'a>(&'a Accepting, u64);
        impl Drop for Withdraw<'_> {
            fn drop(&mut self) {
                self.0.withdraw(self.1);
            }
        }
        let _withdraw = Withdraw(accepting, id);
        let conn = rx.await.unwrap_or_else(|_| Err(no_answer()))?;
        AsyncConnection::wrap_serving(conn, self.serving.clone())
    }
}
