//! Setting up an [`AsyncConnection`]: the async TCP handshake, RDMA CM on the blocking pool, a
//! loopback pair, and wrapping a set-up connection with its driver and control tasks.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::ToSocketAddrs;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::transfer::engine::spin::Spin;
use crate::transfer::front::aio::{control, driver, scratch, AsyncConnection, Shared};
use crate::transfer::setup::control::Established;
use crate::transfer::setup::handshake;
use crate::transfer::setup::tokio_wire::TokioDial;
use crate::transfer::{Connection, Options, WaitMode};
use crate::verbs::Pd;

/// Options for a connection whose completions the async driver handles: CQs on a completion
/// channel, whatever wait mode was asked for.
pub(crate) fn async_options(mut opts: Options) -> Result<Options> {
    if opts.shared_receive.is_some() {
        return Err(Error::InvalidArgument(
            "async connections receive through their own queues: Options::shared_receive is for blocking ones".into(),
        ));
    }
    opts.wait.mode = WaitMode::Event;
    Ok(opts)
}

/// Resolves `addr` without blocking the executor.
async fn resolve(addr: impl ToSocketAddrs) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|source| Error::Io { what: "resolving the peer address".into(), source })?
        .collect();
    if addrs.is_empty() {
        return Err(Error::InvalidArgument("the address resolved to nothing".into()));
    }
    Ok(addrs)
}

/// Runs blocking setup on tokio's blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::Io {
        what: "connection setup on tokio's blocking pool".into(),
        source: std::io::Error::other(e),
    })?
}

impl AsyncConnection {
    /// Connects to a [`crate::transfer::Listener`] or [`crate::transfer::AsyncListener`] at
    /// `addr`, in `pd`. The TCP exchange runs as async code on the runtime (the connect retried
    /// while refused, all within [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout), as [`Connection::connect_with`]
    /// does). Call it inside a tokio runtime with I/O and time enabled. Cancelling the future
    /// closes what it set up so far.
    ///
    /// # Errors
    /// As [`Connection::connect_with`]; [`Error::Io`] also if the runtime lacks I/O or timers.
    pub async fn connect(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<AsyncConnection> {
        AsyncConnection::connect_with(addr, pd, opts, &[]).await
    }

    /// Connects, sending `blob` to the peer with this side's endpoint.
    ///
    /// # Errors
    /// As [`AsyncConnection::connect`].
    pub async fn connect_with(
        addr: impl ToSocketAddrs,
        pd: &Pd,
        opts: Options,
        blob: &[u8],
    ) -> Result<AsyncConnection> {
        crate::transfer::front::aio::reactor::require_io_and_timers(
            "connecting (it needs a tokio runtime with I/O and time enabled)",
        )?;
        let addrs = resolve(addr).await?;
        let opts = async_options(opts)?;
        let conn = handshake::connect(TokioDial, &addrs, pd, &opts, blob, true).await?;
        AsyncConnection::wrap(conn)
    }

    /// Connects through the RDMA connection manager to an [`crate::transfer::AsyncCmListener`]
    /// or a [`crate::transfer::CmListener`] at `addr` (an IP address of the peer's RDMA device),
    /// sending `blob` (≤ [`crate::transfer::MAX_ASYNC_CM_BLOB`] bytes). The CM exchange runs on
    /// tokio's blocking pool. It offers a control channel in the CM's private data: with an
    /// `AsyncCmListener` remote memory works as over TCP; a blocking `CmListener` ignores the
    /// offer, and remote memory calls then fail with [`Error::NoControlChannel`].
    ///
    /// # Errors
    /// As [`Connection::connect_cm_with`] (with the smaller blob limit); [`Error::Io`] also if
    /// the runtime has no I/O driver or the setup task on the blocking pool panics or is
    /// cancelled.
    pub async fn connect_cm_with(
        addr: impl ToSocketAddrs,
        pd: &Pd,
        opts: Options,
        blob: &[u8],
    ) -> Result<AsyncConnection> {
        AsyncConnection::set_up_cm(addr, pd, opts, blob).await
    }

    /// Connects through the RDMA connection manager, sending no blob: as
    /// [`AsyncConnection::connect_cm_with`].
    ///
    /// # Errors
    /// As [`AsyncConnection::connect_cm_with`].
    pub async fn connect_cm(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<AsyncConnection> {
        AsyncConnection::connect_cm_with(addr, pd, opts, &[]).await
    }

    /// Resolves `addr`, runs the blocking CM `connect` on tokio's blocking pool, wraps the
    /// result.
    async fn set_up_cm(addr: impl ToSocketAddrs, pd: &Pd, opts: Options, blob: &[u8]) -> Result<AsyncConnection> {
        let addrs = resolve(addr).await?;
        let (pd, blob) = (pd.clone(), blob.to_vec());
        let conn =
            blocking(move || Connection::connect_cm_offering(&addrs[..], &pd, async_options(opts)?, &blob, true))
                .await?;
        AsyncConnection::wrap(conn)
    }

    /// Two connected async connections in `pd` on one device (loopback), as
    /// [`Connection::pair`]. Call it inside a tokio runtime.
    ///
    /// # Errors
    /// As [`Connection::pair`]; [`Error::Io`] outside a tokio runtime with I/O enabled.
    pub fn pair(pd: &Pd, opts: &Options) -> Result<(AsyncConnection, AsyncConnection)> {
        let (a, b) = Connection::pair_with(pd, &async_options(opts.clone())?, true)?;
        Ok((AsyncConnection::wrap(a)?, AsyncConnection::wrap(b)?))
    }

    /// Makes a connection set up with [`WaitMode::Event`] async (with its control channel, if
    /// setup made one).
    pub(crate) fn wrap(est: Established) -> Result<AsyncConnection> {
        AsyncConnection::wrap_serving(est, None)
    }

    /// As `wrap`, lending from `serving` (if any) from the peer's first control message on.
    pub(crate) fn wrap_serving(
        est: Established,
        serving: Option<(crate::heap::Heap, crate::transfer::RemoteLimits)>,
    ) -> Result<AsyncConnection> {
        let (conn, control) = est.into_parts();
        AsyncConnection::wrap_parts(conn, control, serving)
    }

    /// An async connection over `conn`; `control` (its control channel) becomes one too, driven
    /// by the control task.
    fn wrap_parts(
        conn: Connection,
        control: Option<Connection>,
        serving: Option<(crate::heap::Heap, crate::transfer::RemoteLimits)>,
    ) -> Result<AsyncConnection> {
        let channel = conn.core().channel().cloned().ok_or_else(|| {
            Error::InvalidArgument("an async connection needs CQs on a completion channel (WaitMode::Event)".into())
        })?;
        let control = control.map(|c| AsyncConnection::wrap_parts(c, None, None)).transpose()?.map(control::new);
        let (control_stop, stop_control) = tokio::sync::watch::channel(());
        let stop = Arc::new(Notify::new());
        let shared = Arc::new(Shared {
            waiters: driver::Waiters::default(),
            spin: Spin::new(conn.options().wait.spin),
            words: scratch::Words::new(conn.pd(), 8),
            stop: stop.clone(),
            driver_alive: std::sync::atomic::AtomicBool::new(false),
            backlog: parking_lot::Mutex::new(Default::default()),
            control: control.as_ref().map(|(cs, _)| cs.clone()),
            control_stop: Some(control_stop),
            conn: std::mem::ManuallyDrop::new(conn),
        });
        driver::spawn(&shared, channel, stop)?;
        if let Some((cs, parts)) = control {
            cs.lending().lock().set_serving(serving);
            control::spawn(&cs, &shared, parts, stop_control);
        }
        Ok(AsyncConnection { shared })
    }
}
