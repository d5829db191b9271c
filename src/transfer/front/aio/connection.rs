//! `AsyncConnection`: the operations of a connection as futures over owned buffers.

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;

use tokio::net::ToSocketAddrs;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::engine::completion::Failure;
use crate::transfer::engine::spin::Spin;
use crate::transfer::front::aio::op::{BufferBack, Delivered, NoBytes, Op, TargetBack};
use crate::transfer::front::aio::wire::Msg;
use crate::transfer::front::aio::{control, driver, scratch, Shared};
use crate::transfer::front::ops::immediate_of;
use crate::transfer::request::owned::{OwnedGather, OwnedScatter};
use crate::transfer::request::received::Posted;
use crate::transfer::request::{Action, SgeList};
use crate::transfer::setup::control::Established;
use crate::transfer::setup::handshake;
use crate::transfer::setup::tokio_wire::TokioDial;
use crate::transfer::{Connection, Options, Received, Rejected, WaitMode};
#[cfg(doc)]
use crate::transfer::{IoBuf, IoTarget};
use crate::verbs::{Endpoint, Pd};

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
///   thread: the TCP setup exchange runs as async code on the runtime (creating and connecting
///   a queue pair are short kernel calls); RDMA CM setup runs on tokio's blocking pool.
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
        super::reactor::require_io_and_timers("connecting (it needs a tokio runtime with I/O and time enabled)")?;
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
            cs.lending.lock().serving = serving;
            control::spawn(&cs, &shared, parts, stop_control);
        }
        Ok(AsyncConnection { shared })
    }

    fn conn(&self) -> &Connection {
        self.shared.conn()
    }

    /// The PD local memory must be registered in.
    pub fn pd(&self) -> &Pd {
        self.conn().pd()
    }

    /// The peer's endpoint.
    pub fn peer(&self) -> &Endpoint {
        self.conn().peer()
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

    /// Checks `action` on `sges` (`buf`'s memory, or why it has none) and starts it on `buf`;
    /// a refusal finishes the future at once. Also returns what the completion is interpreted
    /// against.
    #[inline(always)]
    fn start<B: Send + 'static>(&self, buf: B, sges: Result<SgeList>, action: Action<'_>) -> (Op<B>, Posted) {
        match sges.and_then(|sges| self.conn().request(action, sges)) {
            Ok(req) => {
                let posted = req.posted();
                (Op::start(self.shared.clone(), buf, req), posted)
            }
            Err(e) => (Op::refused(self.shared.clone(), buf, e), Posted::Send(0)),
        }
    }

    /// RDMA WRITE of all of `buf` — one owned buffer ([`IoBuf`]), or a gather list of them
    /// (`Vec<B>`, `[B; N]`) written as the concatenation of its parts — to `offset` in
    /// `remote`; gives the buffer (the whole list) back.
    ///
    /// # Errors
    /// The buffer (all of a list) comes back in [`Rejected`] with:
    /// - not posted, untouched: [`Error::NotRegistered`] (a part not registered in this
    ///   connection's PD), [`Error::OutOfBounds`] (the range does not fit in `remote`),
    ///   [`Error::NotGranted`] (the peer does not grant `REMOTE_WRITE` — `REMOTE_READ` for a
    ///   READ —, see [`AsyncConnection::peer_grants`]),
    ///   [`Error::InvalidArgument`] (an empty buffer or part, no parts, more parts than the
    ///   queue pair's scatter/gather entries, over 4 GiB - 1 bytes in all), the
    ///   connection's failure, at the call or while waiting for room ([`Error::Operation`],
    ///   [`Error::Verbs`], [`Error::Closed`]), or [`Error::Verbs`] if the device refuses the post;
    /// - [`Error::Operation`] if the WRITE failed, or was flushed after another failure
    ///   ([`Error::Closed`] after a close); [`Error::Verbs`] if polling the CQ failed. These fail
    ///   the connection; the future finishes once the flush is reaped (no timeout).
    pub fn write<B: OwnedGather>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Write { remote, offset, imm: None }).0)
    }

    /// RDMA WRITE that also delivers `imm` to the peer (consuming one of its receives).
    ///
    /// # Errors
    /// As [`AsyncConnection::write`].
    pub fn write_with_imm<B: OwnedGather>(
        &self,
        buf: B,
        remote: &RemoteBuf,
        offset: u64,
        imm: u32,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Write { remote, offset, imm: Some(imm) }).0)
    }

    /// RDMA READ filling all of `buf` — one owned target ([`IoTarget`]), or a scatter list of
    /// them (`Vec<B>`, `[B; N]`) filled in order — from `offset` in `remote`; gives the buffer
    /// back. The target may be uninitialised memory ([`crate::heap::UninitBuffer`]): once the future
    /// returns it `Ok`, all of it is initialised.
    ///
    /// # Errors
    /// As [`AsyncConnection::write`].
    pub fn read<B: OwnedScatter>(
        &self,
        mut buf: B,
        remote: &RemoteBuf,
        offset: u64,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().target_sges(&mut buf);
        let (op, posted) = self.start(buf, sges, Action::Read { remote, offset });
        TargetBack(Delivered::new(op, posted))
    }

    /// SEND of all of `buf` — one owned buffer, or a gather list of them sent as one message —
    /// (the peer must have a receive posted).
    ///
    /// # Errors
    /// As [`AsyncConnection::write`] (no remote range).
    pub fn send<B: OwnedGather>(
        &self,
        buf: B,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Send { imm: None }).0)
    }

    /// SEND with immediate data.
    ///
    /// # Errors
    /// As [`AsyncConnection::send`].
    pub fn send_with_imm<B: OwnedGather>(
        &self,
        buf: B,
        imm: u32,
    ) -> impl Future<Output = std::result::Result<B, Rejected<B>>> + Send + 'static {
        let sges = self.conn().owned_sges(&buf);
        BufferBack(self.start(buf, sges, Action::Send { imm: Some(imm) }).0)
    }

    /// Posts `buf` as a receive (at call time) — one owned target, or a scatter list of them
    /// (`Vec<B>`, `[B; N]`) filled in order, [`Received::len`] counting the bytes of all parts —
    /// and completes when the peer's SEND fills it, or
    /// when its RDMA WRITE with immediate consumes it (nothing written into `buf`:
    /// [`Arrival::ImmediateOnly`](crate::transfer::Arrival), `len` 0). Receives
    /// complete in the order they were posted. The buffer may be uninitialised memory
    /// ([`crate::heap::UninitBuffer`]): once the future returns it `Ok`, the bytes that arrived
    /// are initialised.
    ///
    /// # Errors
    /// As [`AsyncConnection::write`] (no remote range); [`Error::InvalidArgument`] when the
    /// receive queue is full.
    pub fn recv<B: OwnedScatter>(
        &self,
        mut buf: B,
    ) -> impl Future<Output = std::result::Result<(B, Received), Rejected<B>>> + Send + 'static {
        let sges = self.conn().target_sges(&mut buf);
        let (op, posted) = self.start(buf, sges, Action::Recv);
        Delivered::new(op, posted)
    }

    /// Posts a receive without memory and completes with the immediate of the peer's WRITE with
    /// immediate (or empty SEND with immediate).
    ///
    /// # Errors
    /// As [`AsyncConnection::recv`]; [`Error::Protocol`] if the peer sent an empty SEND without
    /// an immediate (a SEND with bytes fails the receive: it has no room).
    pub fn recv_imm(&self) -> impl Future<Output = Result<u32>> + Send + 'static {
        let (op, posted) = self.start(NoBytes, Ok(SgeList::Empty), Action::RecvImm);
        async move {
            let (_, got) = op.await.map_err(|r| r.error)?;
            immediate_of(got.delivered(posted)?)
        }
    }

    fn atomic(&self, action: Action<'_>) -> impl Future<Output = Result<u64>> + Send + 'static {
        let started = self.shared.words.take().map(|word| {
            let sges = self.conn().owned_sges(&word);
            self.start(word, sges, action).0
        });
        async move {
            let (word, _) = started?.await.map_err(|r| r.error)?;
            Ok(word.value())
        }
    }

    /// Atomically adds `add` to the 64-bit word at `offset` in `remote`; returns its old value.
    ///
    /// # Errors
    /// No buffer is involved (the landing word is the connection's):
    /// - [`Error::OutOfBounds`] if the 8-byte word at `offset` is not inside `remote`;
    ///   [`Error::InvalidArgument`] if it is not 8-byte aligned;
    /// - [`Error::Io`] or [`Error::Verbs`] if a new page of landing words cannot be mapped or
    ///   registered;
    /// - otherwise as [`AsyncConnection::write`] (the peer must grant `REMOTE_ATOMIC`).
    pub fn fetch_add(
        &self,
        remote: &RemoteBuf,
        offset: u64,
        add: u64,
    ) -> impl Future<Output = Result<u64>> + Send + 'static {
        self.atomic(Action::FetchAdd { remote, offset, add })
    }

    /// Atomically replaces the 64-bit word at `offset` with `swap` if it equals `compare`;
    /// returns its old value (equal to `compare` when the swap happened).
    ///
    /// # Errors
    /// As [`AsyncConnection::fetch_add`].
    pub fn compare_swap(
        &self,
        remote: &RemoteBuf,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> impl Future<Output = Result<u64>> + Send + 'static {
        self.atomic(Action::CompareSwap { remote, offset, compare, swap })
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
            let _ = cs.out.send(Msg::Bye);
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
