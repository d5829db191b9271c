//! `AsyncListener`: accepts connections without blocking an executor thread.

use std::net::SocketAddr;

use tokio::net::{TcpListener, ToSocketAddrs};

use crate::error::{Error, Result};
use crate::transfer::aio::connection::{async_options, blocking};
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
}

impl AsyncListener {
    /// Listens on `addr` for connections in `pd`.
    ///
    /// # Errors
    /// [`Error::Io`] if binding fails (or there is no tokio runtime with I/O enabled).
    pub async fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<AsyncListener> {
        let tcp = TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Io { what: "binding the TCP listener".into(), source })?;
        Ok(AsyncListener { tcp, pd: pd.clone(), opts: async_options(opts) })
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
    /// As [`Listener::accept_with`].
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
        let conn = blocking(move || Listener::serve(s, peer, &pd, &opts, &blob)).await?;
        AsyncConnection::wrap(conn)
    }
}
