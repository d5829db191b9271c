//! `AsyncListener`: accepts connections without blocking an executor thread; its TCP accepting
//! and its handshakes are tasks on the runtime.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::ToSocketAddrs;

use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::transfer::front::aio::connection::async_options;
use crate::transfer::front::aio::lending::{check_lending_heap, RemoteLimits};
use crate::transfer::front::aio::reactor::require_io_and_timers;
use crate::transfer::setup::acceptor::{self, no_answer, Accepting, Reply};
use crate::transfer::setup::tokio_wire::TokioWire;
use crate::transfer::{AsyncConnection, Options};
use crate::verbs::Pd;

/// How long accepting pauses after `accept(2)` failed (EMFILE and friends).
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Accepts RDMA connections whose endpoints arrive over TCP, as
/// [`crate::transfer::Listener`] does (handshakes side by side, several at once, each within
/// [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout)), for tokio: the TCP accepting is a task on the runtime and each
/// handshake another (no thread of its own); an accept call is a future that waits for a
/// handshake to serve. Peers connect with [`AsyncConnection::connect`] or
/// [`crate::transfer::Connection::connect`].
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
pub struct AsyncListener {
    addr: SocketAddr,
    accepting: Arc<Accepting>,
    /// The task taking TCP connections (aborted with the listener).
    acceptor: tokio::task::JoinHandle<()>,
    serving: Option<(Heap, RemoteLimits)>,
    /// A fork()ed child's task handle is the parent runtime's.
    born: crate::fork::Born,
}

impl std::fmt::Debug for AsyncListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncListener")
            .field("addr", &self.addr)
            .field("handshakes", &self.accepting.in_flight())
            .finish_non_exhaustive()
    }
}

impl AsyncListener {
    /// Listens on `addr` for connections in `pd`. Call it inside a tokio runtime with I/O and
    /// time enabled.
    ///
    /// # Errors
    /// [`Error::Io`] if the runtime lacks I/O or timers, `addr` cannot be resolved or bound, or
    /// the socket cannot be registered with the runtime's reactor. [`Error::DeviceRemoved`] if
    /// `pd`'s device was removed.
    pub async fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<AsyncListener> {
        require_io_and_timers("binding an AsyncListener (it needs a tokio runtime with I/O and time enabled)")?;
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(|source| Error::Io { what: "resolving the listener's address".into(), source })?
            .collect();
        let opts = async_options(opts)?;
        pd.context().usable_for_new()?;
        let (tcp, addr) = acceptor::bind(&addrs[..])?;
        let tcp = tokio::net::TcpListener::from_std(tcp)
            .map_err(|source| Error::Io { what: "registering the listener with the reactor".into(), source })?;
        let accepting = Accepting::new(pd, &opts, true);
        let acceptor = tokio::spawn(accept_loop(tcp, accepting.clone()));
        Ok(AsyncListener { addr, accepting, acceptor, serving: None, born: crate::fork::Born::now() })
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
        check_lending_heap(heap, self.accepting.pd())?;
        self.serving = Some((heap.clone(), limits));
        Ok(())
    }

    /// How many client setups are running now (see
    /// [`crate::transfer::Listener::handshakes_in_flight`]).
    pub fn handshakes_in_flight(&self) -> usize {
        self.accepting.in_flight()
    }

    /// How many clients' setups failed since the listener was bound.
    pub fn failed_handshakes(&self) -> u64 {
        self.accepting.failed_total()
    }

    /// The most recent failed client setups (at most 64), oldest first, taken out.
    pub fn take_handshake_failures(&self) -> Vec<crate::transfer::HandshakeFailure> {
        self.accepting.take_failures()
    }

    /// The address it listens on.
    ///
    /// # Errors
    /// None at present (the address is read when binding).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.addr)
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
    /// A client whose setup fails is that client's problem, as for
    /// [`crate::transfer::Listener::accept_with`]:
    /// the future goes on waiting for the next one ([`AsyncListener::failed_handshakes`],
    /// [`AsyncListener::take_handshake_failures`]).
    ///
    /// # Errors
    /// As [`crate::transfer::Listener::accept_with`]; [`Error::Io`] if the connection cannot be
    /// registered with the runtime's reactor.
    pub async fn accept_with(&self, blob: &[u8]) -> Result<AsyncConnection> {
        let accepting = &self.accepting;
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

impl Drop for AsyncListener {
    fn drop(&mut self) {
        if !self.born.here() {
            return;
        }
        // The socket closes once the runtime drops the aborted task; handshakes waiting for an
        // accept call end (the others finish or fail within their deadlines, as their tasks).
        self.acceptor.abort();
        self.accepting.stop();
    }
}

/// Takes TCP connections while fewer than `max_handshakes` handshakes are in flight (further
/// clients wait in the kernel's backlog) and runs each handshake as a task of its own.
async fn accept_loop(tcp: tokio::net::TcpListener, accepting: Arc<Accepting>) {
    loop {
        poll_fn(|cx| accepting.poll_room(cx)).await;
        let (s, peer) = match tcp.accept().await {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: say so, let some handshakes finish, go on.
                tracing::warn!("accepting a TCP connection failed: {e}");
                tokio::time::sleep(ACCEPT_PAUSE).await;
                continue;
            }
        };
        // Only this task admits: the room seen above is still there.
        let Some(slot) = accepting.admit() else { continue };
        let deadline = accepting.deadline();
        match TokioWire::new(s, deadline) {
            Ok(wire) => drop(tokio::spawn(accepting.clone().handshake(wire, peer, deadline, slot))),
            Err(e) => tracing::warn!(%peer, "setting up an accepted TCP connection failed ({e}); closed"),
        }
    }
}
