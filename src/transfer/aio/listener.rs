//! `AsyncListener`: accepts connections without blocking an executor thread.

use std::net::SocketAddr;

use tokio::net::{TcpListener, ToSocketAddrs};

use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::transfer::aio::connection::{async_options, blocking};
use crate::transfer::aio::lending::{check_lending_heap, RemoteLimits};
use crate::transfer::{AsyncConnection, Listener, Options};
use crate::verbs::Pd;

/// Accepts RDMA connections whose endpoints arrive over TCP, as [`Listener`] does, for tokio:
/// the TCP accept is async and the exchange runs on tokio's blocking pool. Peers connect with
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
    tcp: TcpListener,
    pd: Pd,
    opts: Options,
    /// What accepted connections lend their peers from their first message on.
    serving: Option<(Heap, RemoteLimits)>,
}

impl AsyncListener {
    /// Listens on `addr` for connections in `pd`.
    ///
    /// # Errors
    /// [`Error::Io`] if `addr` cannot be resolved or bound. (A runtime without I/O enabled
    /// makes tokio panic here; it is not reported as an error.)
    pub async fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<AsyncListener> {
        let tcp = TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Io { what: "binding the TCP listener".into(), source })?;
        Ok(AsyncListener { tcp, pd: pd.clone(), opts: async_options(opts), serving: None })
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
        check_lending_heap(heap, &self.pd)?;
        self.serving = Some((heap.clone(), limits));
        Ok(())
    }

    /// The address it listens on.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot report it.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.tcp.local_addr().map_err(|source| Error::Io { what: "reading the listener's address".into(), source })
    }

    /// Accepts the next connection.
    ///
    /// # Errors
    /// As [`AsyncListener::accept_with`].
    pub async fn accept(&self) -> Result<AsyncConnection> {
        self.accept_with(Vec::new()).await
    }

    /// Accepts the next connection, sending `blob` to the peer with this side's endpoint.
    ///
    /// Cancelling the future while it waits for a TCP connection loses nothing; once a peer is
    /// accepted, its exchange runs to the end on the blocking pool and a cancelled accept drops
    /// the finished connection (the peer sees it close).
    ///
    /// # Errors
    /// As [`Listener::accept_with`]; [`Error::Io`] also if the accepted stream cannot be taken
    /// from the reactor and made blocking, the setup task on the blocking pool panics or is
    /// cancelled, or the connection cannot be registered with the runtime's reactor.
    pub async fn accept_with(&self, blob: Vec<u8>) -> Result<AsyncConnection> {
        let (s, peer) = self
            .tcp
            .accept()
            .await
            .map_err(|source| Error::Io { what: "accepting a TCP connection".into(), source })?;
        let s = s.into_std().map_err(|source| Error::Io { what: "taking the accepted TCP stream".into(), source })?;
        s.set_nonblocking(false)
            .map_err(|source| Error::Io { what: "making the accepted TCP stream blocking".into(), source })?;
        let (pd, opts) = (self.pd.clone(), self.opts.clone());
        let conn = blocking(move || Listener::serve(s, peer, &pd, &opts, &blob, true)).await?;
        AsyncConnection::wrap_serving(conn, self.serving.clone())
    }
}
