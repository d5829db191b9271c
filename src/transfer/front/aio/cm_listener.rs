//! `AsyncCmListener`: accepts RDMA CM connections without blocking an executor thread.

use std::os::fd::{AsRawFd, RawFd};

use tokio::io::unix::AsyncFd;

use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::transfer::front::aio::connection::{async_options, blocking};
use crate::transfer::front::aio::lending::{check_lending_heap, RemoteLimits};
use crate::transfer::front::aio::reactor::register_readable;
use crate::transfer::setup::cm::{accept_request, check_accept_blob, CmListener};
use crate::transfer::{AsyncConnection, Options};
use crate::verbs::Pd;

/// The listener's event channel, as tokio's reactor sees it.
struct ListenerFd(CmListener);

impl AsRawFd for ListenerFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd()
    }
}

/// Accepts connections through the RDMA connection manager, as [`CmListener`] does, for tokio:
/// connect requests are awaited on the reactor (the CM event channel is non-blocking) and each
/// accepted connection is set up on tokio's blocking pool. Peers connect with
/// [`AsyncConnection::connect_cm`] (then both sides have a control channel, and remote memory
/// works as over TCP) or [`crate::transfer::Connection::connect_cm`] (then they have none:
/// remote memory calls fail with [`Error::NoControlChannel`]).
///
/// ```no_run
/// # async fn f(pd: &mralloc::verbs::Pd) -> mralloc::Result<()> {
/// use mralloc::transfer::{AsyncCmListener, Options};
/// // An IP address of the local RDMA device (RDMA CM routes by address).
/// let listener = AsyncCmListener::bind("192.168.1.10:7471", pd, Options::default())?;
/// loop {
///     match listener.accept().await {
///         Ok(conn) => drop(tokio::spawn(async move { /* serve `conn` */ drop(conn) })),
///         // One peer's failure (a malformed request, a client that gave up): go on.
///         Err(e) => eprintln!("accept: {e}"),
///     }
/// }
/// # }
/// ```
pub struct AsyncCmListener {
    fd: AsyncFd<ListenerFd>,
    pd: Pd,
    opts: Options,
    serving: Option<(Heap, RemoteLimits)>,
}

impl std::fmt::Debug for AsyncCmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCmListener").field("fd", &self.fd.get_ref().0.fd()).finish_non_exhaustive()
    }
}

impl AsyncCmListener {
    /// Listens on `addr` (an IP address of a local RDMA device, and a port). Call it inside a
    /// tokio runtime with I/O enabled.
    ///
    /// # Errors
    /// As [`CmListener::bind`]; [`Error::Io`] if there is no tokio runtime with I/O enabled, or
    /// the event channel cannot be made non-blocking or registered with it.
    pub fn bind(addr: impl std::net::ToSocketAddrs, pd: &Pd, opts: Options) -> Result<AsyncCmListener> {
        let opts = async_options(opts)?;
        let listener = CmListener::bind(addr, pd, opts.clone())?;
        listener.set_nonblocking()?;
        let what = "registering an RDMA CM event channel with tokio (it needs a runtime with I/O enabled)";
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::Io { what: what.into(), source: std::io::Error::other(e.to_string()) })?;
        // SAFETY: the descriptor belongs to the listener's event channel inside the ListenerFd,
        // which the AsyncFd owns: it stays open, and is the same descriptor, until the AsyncFd
        // is dropped.
        let fd = unsafe { register_readable(&handle, ListenerFd(listener), what) }?;
        Ok(AsyncCmListener { fd, pd: pd.clone(), opts, serving: None })
    }

    /// Makes every connection accepted from now on lend its peer memory of `heap` within
    /// `limits`, as [`crate::transfer::AsyncListener::serve_remote_memory`].
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

    /// Accepts the next connection.
    ///
    /// # Errors
    /// As [`AsyncCmListener::accept_with`].
    pub async fn accept(&self) -> Result<AsyncConnection> {
        self.accept_with(&[]).await
    }

    /// Accepts the next connection, answering with `blob` (at most
    /// [`crate::transfer::MAX_ASYNC_CM_ACCEPT_BLOB`] bytes: the rest of the CM's private data
    /// offers the control channel).
    ///
    /// Cancelling the future while it waits for a connect request loses nothing; once a request
    /// is taken, the accept runs to the end on the blocking pool and a cancelled accept drops
    /// the finished connection (the peer sees it close).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `blob` is too long or the request came through another device
    /// than the PD's; [`Error::Timeout`] if the peer does not confirm the connection within
    /// [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout);
    /// [`Error::Protocol`] for a malformed request, a peer that rejected or dropped the connection
    /// meanwhile; [`Error::DeviceRemoved`] once the listener's device was removed (noticed within
    /// about a second); [`Error::Verbs`] if an RDMA CM or verbs call fails; [`Error::Io`] if the
    /// event channel cannot be read, the setup task on the blocking pool panics or is cancelled, or
    /// the connection cannot be registered with the runtime's reactor. Otherwise as
    /// [`CmListener::accept_with`]. Only a removed device ends the listener: after any other error
    /// (one peer's), accept the next connection.
    pub async fn accept_with(&self, blob: &[u8]) -> Result<AsyncConnection> {
        check_accept_blob(blob, true)?;
        // A look at the device once a second (a wildcard listener gets no DEVICE_REMOVAL of
        // its own), where the runtime has timers.
        let timers = super::reactor::has_timers();
        let req = loop {
            let readable = self.fd.readable();
            let ready = if timers {
                tokio::time::timeout(std::time::Duration::from_secs(1), readable).await.ok()
            } else {
                Some(readable.await)
            };
            let Some(ready) = ready else {
                if let Some(req) = self.fd.get_ref().0.try_request()? {
                    break req;
                }
                continue;
            };
            let mut ready =
                ready.map_err(|source| Error::Io { what: "waiting for an RDMA CM connect request".into(), source })?;
            match ready.get_inner().0.try_request()? {
                Some(req) => break req,
                None => ready.clear_ready(),
            }
        };
        let (pd, opts, blob) = (self.pd.clone(), self.opts.clone(), blob.to_vec());
        let conn = blocking(move || accept_request(req, &pd, &opts, &blob, true)).await?;
        AsyncConnection::wrap_serving(conn, self.serving.clone())
    }
}
