//! `Connection`: one RC queue pair with its CQs, completion routing and failure state.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Disconnect, Error, Result};
use crate::transfer::completion::{Completed, Core, Failure, Mode, Outcome, Ticket};
use crate::transfer::exact::Windows;
use crate::transfer::keepalive::{Keepalive, MAX_KEEPALIVE};
use crate::transfer::local::Sges;
use crate::transfer::stats::ConnectionStats;
use crate::transfer::watch::{watch, Link, Registration, Source};
use crate::transfer::{Options, WaitMode};
use crate::verbs::{Access, Cq, Endpoint, Pd, Qp, RegisteredBuf, SendFlags, SendOp, SendWr, Sge, WcStatus};

/// How long a failed connection waits for the device to flush its outstanding requests before
/// it declares their memory lost (leaked, never released).
pub(crate) const FLUSH_WAIT: Duration = Duration::from_secs(5);

/// A reliable connection to one peer. Operations are in [`crate::transfer`]'s `ops`, `pending`
/// and `batch` modules; this type owns the queue pair and routes completions to their waiters.
///
/// Once any operation fails (a failed completion, a timeout, a failing verbs call on the
/// completion path), the QP is in the error state and every later post fails fast with the
/// original error. [`Connection::close`] (or dropping the connection) moves the QP to the error
/// state, waits for the device to flush what is outstanding and releases the buffers of
/// operations nobody waits for.
///
/// An idle peer is not a dead one: a receive waits as long as the peer stays silent (unless
/// [`Options::recv_timeout`] says otherwise). A dead one is found by mralloc's watcher thread,
/// which fails the connection with [`Error::Disconnected`] (flushing whatever is outstanding) when
/// the TCP stream it was set up over closes (the peer dropped the connection or its process
/// exited), RDMA CM reports it disconnected, the device reports its port down, its QP in
/// error or a fatal error, or — with [`Options::keepalive`], for peers whose host or path dies
/// without a word — a probe goes unanswered.
///
/// `fork()`: a child's copy of a connection is the parent's. Every operation on it fails with
/// [`Error::Forked`] (before taking any lock a parent thread may have held at the fork), and
/// dropping it destroys nothing (the QP, its CM id and the buffers it holds stay the
/// parent's, which keeps using them). The child may open devices and connect on its own.
pub struct Connection {
    /// Destroyed in `Drop`, before the buffers still held are released.
    qp: ManuallyDrop<Qp>,
    pd: Pd,
    peer: Endpoint,
    peer_blob: Vec<u8>,
    opts: Options,
    core: Arc<Core>,
    next_id: AtomicU64,
    /// 8-byte landing zone for atomics' old values.
    scratch: Mutex<RegisteredBuf>,
    /// Keeps the connection (and its control channel) watched: dropped first, before what it
    /// names (the QP, the TCP stream or CM channel in `kept`) goes away — in `Drop`, and by
    /// field order should that unwind.
    watch: Option<Registration>,
    /// What the setup path must keep alive as long as the connection (its TCP stream, its RDMA
    /// CM id and channel), dropped after the QP is destroyed.
    kept: Vec<Box<dyn Send + Sync>>,
    /// The control channel (see the `control` module), until the async front end takes it.
    control: Option<Box<Connection>>,
    /// What the connection watcher fails this connection through.
    link: Arc<Link>,
    /// The other end of a [`Connection::pair`]: told when this end goes away (no stream or CM
    /// id tells it, the process being the same).
    pair_peer: Option<Weak<Link>>,
    /// The memory windows of grants and lent memory bound through this QP and not released
    /// yet: deallocated in `Drop` once the QP is flushed, before it is destroyed.
    windows: Arc<Windows>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("local", &self.qp.endpoint())
            .field("peer", &self.peer)
            .field("failed", &self.core.failure())
            .finish()
    }
}

/// What one attempt to post a chain did.
enum Attempt {
    /// Posted whole; the signaled tail's id.
    Posted(u64),
    /// No send-queue room: nothing posted.
    Full,
    /// The device accepted only the first `n` requests (the connection must be failed and their
    /// flush awaited).
    Partial(Error, u32),
}

impl Connection {
    /// Creates the QP (INIT) and CQs for a connection in `pd`.
    pub(crate) fn prepare(pd: &Pd, opts: &Options) -> Result<(Qp, Cq, Cq)> {
        let ctx = pd.context();
        // With a shared receive queue the connection's own receive CQ stays empty (the QP
        // completes receives on the shared receiver's CQ): one entry is enough.
        let recv_depth = if opts.shared_receive.is_some() { 1 } else { opts.recv_depth + 8 };
        let (send_cq, recv_cq) = if matches!(opts.wait, WaitMode::Event) {
            let ch = crate::verbs::CompChannel::new(ctx)?;
            (Cq::with_channel(ctx, opts.send_depth + 8, &ch)?, Cq::with_channel(ctx, recv_depth, &ch)?)
        } else {
            (Cq::new(ctx, opts.send_depth + 8)?, Cq::new(ctx, recv_depth)?)
        };
        let mut b = match &opts.shared_receive {
            Some(shared) => Qp::builder(pd, &send_cq, shared.cq()).srq(shared.srq()),
            None => Qp::builder(pd, &send_cq, &recv_cq),
        };
        if let Some(k) = opts.keepalive.filter(|k| k.is_zero() || *k > MAX_KEEPALIVE) {
            return Err(Error::InvalidArgument(format!("a keepalive interval of {k:?} (0 < keepalive <= 1 day)")));
        }
        // A keepalive probe is a zero-length RDMA WRITE: the QP must accept WRITEs (they
        // reach memory only through a key with write rights).
        let keepalive_access = if opts.keepalive.is_some() { Access::REMOTE_WRITE } else { Access::NONE };
        b = b.caps(opts.caps()).remote_access(opts.remote_access | keepalive_access);
        if let Some(p) = opts.port {
            b = b.port(p);
        }
        if let Some(g) = opts.gid_index {
            b = b.gid_index(g);
        }
        Ok((b.build()?, send_cq, recv_cq))
    }

    /// Wraps a QP that is already connected (RTS).
    pub(crate) fn wrap(
        pd: &Pd,
        opts: &Options,
        (qp, send_cq, recv_cq): (Qp, Cq, Cq),
        peer: Endpoint,
        peer_blob: Vec<u8>,
    ) -> Result<Connection> {
        let scratch = RegisteredBuf::new(pd, 64, Access::LOCAL_WRITE)?;
        let mut opts = opts.clone();
        opts.send_depth = qp.caps().max_send_wr.min(opts.send_depth).max(1);
        opts.recv_depth = qp.caps().max_recv_wr.min(opts.recv_depth).max(1);
        let mode = match opts.wait {
            WaitMode::BusyPoll => Mode::BusyPoll,
            WaitMode::Event => Mode::Event,
            WaitMode::Poller(_) => Mode::Poller,
        };
        let core = Arc::new(Core::new(send_cq, recv_cq, mode, opts.spin));
        // What the device was told (an RDMA CM connection's ACK timeout comes from the path, not
        // the options), else what the options asked for.
        let keepalive =
            opts.keepalive.map(|k| Keepalive::new(k, qp.retry_time().unwrap_or_else(|_| opts.retry_time())));
        let link = Arc::new(Link::new(&core, &qp, keepalive));
        if let WaitMode::Poller(p) = &opts.wait {
            p.serve(&core);
        }
        let mut kept: Vec<Box<dyn Send + Sync>> = Vec::new();
        if let Some(shared) = &opts.shared_receive {
            // The queue and its memory outlive the QP (dropped after it).
            kept.push(Box::new(shared.keepalive()));
        }
        tracing::debug!(
            target: "mralloc::transfer",
            qpn = qp.qpn(),
            peer_qpn = peer.qpn,
            send_depth = opts.send_depth,
            recv_depth = opts.recv_depth,
            mode = ?mode,
            "connection established"
        );
        Ok(Connection {
            qp: ManuallyDrop::new(qp),
            pd: pd.clone(),
            peer,
            peer_blob,
            opts,
            core,
            next_id: AtomicU64::new(1),
            scratch: Mutex::new(scratch),
            watch: None,
            kept,
            control: None,
            link,
            pair_peer: None,
            windows: Arc::new(Windows::new()),
        })
    }

    /// Two connections in `pd` connected to each other on one device (loopback): what a single
    /// process needs to exercise both sides. Both get `opts`, [`Options::remote_access`]
    /// included: a pair whose ends RDMA WRITE, READ or use atomics on each other's memory must
    /// ask for those rights.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if a verbs call fails: creating a completion channel, CQ or queue pair,
    ///   connecting it, or registering the connection's landing buffer for atomics.
    /// - [`Error::NoActiveDevice`] or [`Error::NoSuchIndex`] if [`Options::port`] or
    ///   [`Options::gid_index`] (or, unset, their defaults) do not fit `pd`'s device.
    /// - [`Error::InvalidArgument`] if a queue depth is too large for a CQ (above `i32::MAX`).
    /// - [`Error::Io`] if mapping the landing buffer fails.
    pub fn pair(pd: &Pd, opts: &Options) -> Result<(Connection, Connection)> {
        Connection::pair_with(pd, opts, false)
    }

    /// The PD local memory must be registered in.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// The memory windows bound through this connection (see `transfer::exact`).
    pub(crate) fn windows(&self) -> &Arc<Windows> {
        &self.windows
    }

    /// The completion engine: routing, parking, waiting.
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }

    /// The landing word of blocking atomics.
    pub(crate) fn scratch(&self) -> &Mutex<RegisteredBuf> {
        &self.scratch
    }

    /// Keeps `x` (a TCP stream, RDMA CM objects) until the connection is dropped, after its QP.
    pub(crate) fn keep(&mut self, x: impl Send + Sync + 'static) {
        self.kept.push(Box::new(x));
    }

    /// Fault injection: a connection that believes its queues are other than they are.
    #[cfg(test)]
    pub(crate) fn options_mut(&mut self) -> &mut Options {
        &mut self.opts
    }

    /// Starts the connection watcher on this connection and its control channel (if any): the
    /// device's events, and `source` (its setup TCP stream or CM channel, which the connection
    /// must own) if it has one. Call once setup is complete.
    pub(crate) fn start_watch(&mut self, source: Option<Source>) -> Result<()> {
        let mut links = vec![self.link.clone()];
        links.extend(self.control.as_ref().map(|c| c.link.clone()));
        self.watch = Some(watch(self.pd.context(), links, source)?);
        Ok(())
    }

    /// Makes two ends of a pair tell each other when one goes away.
    pub(crate) fn tie(a: &mut Connection, b: &mut Connection) {
        a.pair_peer = Some(Arc::downgrade(&b.link));
        b.pair_peer = Some(Arc::downgrade(&a.link));
        if let (Some(ca), Some(cb)) = (a.control.as_deref_mut(), b.control.as_deref_mut()) {
            Connection::tie(ca, cb);
        }
    }

    /// Attaches the control channel set up with this connection.
    pub(crate) fn set_control(&mut self, control: Connection) {
        self.control = Some(Box::new(control));
    }

    /// Takes the control channel (the async front end drives it).
    #[cfg(feature = "tokio")]
    pub(crate) fn take_control(&mut self) -> Option<Connection> {
        self.control.take().map(|c| *c)
    }

    /// The peer's endpoint.
    pub fn peer(&self) -> &Endpoint {
        &self.peer
    }

    /// The application blob the peer sent while connecting (e.g. an encoded
    /// [`crate::RemoteBuf`]); empty if none.
    pub fn peer_blob(&self) -> &[u8] {
        &self.peer_blob
    }

    /// The queue pair (for inspection).
    pub fn qp(&self) -> &Qp {
        &self.qp
    }

    /// The options in force (queue depths as granted by the device).
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// The error that failed the connection, if any.
    pub fn error(&self) -> Option<Error> {
        self.core.failure().map(Failure::error)
    }

    /// A snapshot of the connection's counters: requests and bytes posted, completions, failed
    /// completions, requests in flight.
    ///
    /// ```no_run
    /// # fn f(conn: &mralloc::transfer::Connection, buf: &mralloc::Buffer, to: &mralloc::RemoteBuf) -> mralloc::Result<()> {
    /// conn.write(&buf[..], to)?;
    /// let s = conn.stats();
    /// assert_eq!((s.send_requests, s.send_bytes, s.errors), (1, buf.len() as u64, 0));
    /// # Ok(()) }
    /// ```
    ///
    /// In a fork()ed child the connection is the parent's: all zero (the counters' locks may
    /// have been held by a parent thread at the fork).
    pub fn stats(&self) -> ConnectionStats {
        if self.usable().is_err() {
            return ConnectionStats::default();
        }
        self.core.stats()
    }

    /// Reaps whatever completions have arrived, without waiting: waiters find their outcomes,
    /// and buffers of dropped operations ([`crate::transfer::Pending`]) whose completion arrived
    /// are freed. Returns how many completions were reaped. (Every operation and wait does this
    /// too; call it when a connection sits idle with parked buffers.)
    ///
    /// # Errors
    /// [`Error::Verbs`] if polling a CQ fails; the connection is failed then.
    /// [`Error::Forked`] in a fork()ed child of the process that made the connection.
    pub fn progress(&self) -> Result<usize> {
        self.usable()?;
        self.core.progress().inspect_err(|e| self.fail(Failure::local(e)))
    }

    /// Closes the connection: moves the QP to the error state (later posts fail with
    /// [`Error::Closed`], or with the failure that came first), waits for the device to flush
    /// every outstanding request, and frees the buffers of operations nobody waits for.
    /// Operations other threads still wait for complete with the flush error and give their
    /// buffers back. Dropping a connection closes it.
    ///
    /// # Errors
    /// [`Error::FlushLost`] (with `wr_id` 0) if the device did not flush within a few seconds (a
    /// device fault, or the queue pair could not be moved to the error state — that failure
    /// itself is not reported): dropping the connection waits once more, and leaks the buffers
    /// still held if the flush has not come by then. Closing twice is not an error.
    /// [`Error::Forked`] in a fork()ed child of the process that made the connection (nothing
    /// is closed: the connection is the parent's).
    pub fn close(&self) -> Result<()> {
        self.usable()?;
        self.fail(Failure::Closed);
        // Idempotent; the QP may already be in the error state (any failed completion puts it
        // there), and a failure recorded first did this already.
        let _ = self.qp.set_error();
        let start = Instant::now();
        let mut spins = 0;
        loop {
            let mark = self.core.mark();
            // A failing poll leaves the flush unseen: keep trying until the deadline.
            let _ = self.core.progress();
            if self.core.quiet() {
                return Ok(());
            }
            if start.elapsed() > FLUSH_WAIT {
                return Err(Error::FlushLost { wr_id: 0, waited: start.elapsed() });
            }
            if self.core.pause(&mut spins, Duration::from_millis(1), mark).is_err() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// [`Error::Forked`] in a fork()ed child of the process that made the connection: checked
    /// before any lock (a parent thread may have held one at the fork).
    #[inline(always)]
    fn usable(&self) -> Result<()> {
        self.qp.born().check("this connection")
    }

    /// Whether this is a fork()ed child's copy of a parent's connection (see [`Connection`]).
    pub(crate) fn forked_copy(&self) -> bool {
        !self.qp.born().here()
    }

    pub(crate) fn check(&self) -> Result<()> {
        self.usable()?;
        match self.core.failure() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }

    pub(crate) fn next_wr_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Fails the connection (first failure wins) and moves the QP to the error state, so the
    /// NIC flushes everything outstanding.
    pub(crate) fn fail(&self, f: Failure) {
        if self.core.fail(f) {
            if let Err(e) = self.qp.set_error() {
                // Without the error state nothing is flushed: waiters give up after FLUSH_WAIT
                // and leak (owned) or abort (borrowed) rather than release memory.
                tracing::error!("moving a failed connection's QP to the error state failed: {e}");
            }
        }
    }

    /// Posts `wrs` (the last one signaled) as one chain, waiting for send-queue room first.
    /// Returns the signaled tail's ticket.
    ///
    /// If the device accepts only part of the chain, the connection is failed and the accepted
    /// part's flush is awaited before the error is returned.
    ///
    /// # Safety
    /// As [`Qp::post_send`]: the memory behind every SGE must stay valid and untouched until the
    /// tail's completion has been claimed with [`Connection::wait`] — and, if this returns
    /// [`Error::FlushLost`], forever (leak or abort).
    pub(crate) unsafe fn post_chain(&self, sges: &[Sge], ops: &[SendOp], flags: SendFlags) -> Result<Ticket> {
        debug_assert_eq!(sges.len(), ops.len());
        // SAFETY: the caller's contract.
        unsafe { self.post_requests(Sges::PerRequest(sges), ops, flags) }
    }

    /// [`Connection::post_chain`] for any [`Sges`] (a single request may gather several).
    ///
    /// # Safety
    /// As [`Connection::post_chain`].
    pub(crate) unsafe fn post_requests(&self, sges: Sges<'_>, ops: &[SendOp], flags: SendFlags) -> Result<Ticket> {
        let k = ops.len() as u32;
        let Some(tail) = ops.last().filter(|_| k <= self.opts.send_depth) else {
            return Err(Error::InvalidArgument(format!("a chain holds 1..={} requests", self.opts.send_depth)));
        };
        // A chain is reported by its signaled tail.
        let op = tail.name();
        // Started by the first full queue: a post that finds room reads no clock.
        let mut watch = self.core.stopwatch();
        loop {
            self.check()?;
            let mark = self.core.mark();
            // SAFETY: the caller's contract.
            match unsafe { self.attempt(sges, ops, flags, true)? } {
                Attempt::Posted(tail) => return Ok(Ticket::send(tail)),
                Attempt::Partial(e, accepted) => return Err(self.after_partial(op, e, accepted)),
                Attempt::Full => {}
            }
            if watch.elapsed() > self.opts.op_timeout {
                return Err(Error::Timeout(self.opts.op_timeout, "send-queue room"));
            }
            self.core.pause(&mut 0, Duration::from_millis(1), mark)?;
        }
    }

    /// Posts one request if the send queue has room (`Ok(None)`: full, nothing posted), without
    /// waiting and without reaping (the async front end posts under its backlog's lock, where
    /// buffers released by a reap must not be dropped: reap first). Returns the request's ticket.
    ///
    /// # Safety
    /// As [`Connection::post_chain`].
    #[cfg(feature = "tokio")]
    pub(crate) unsafe fn try_post_one(&self, sge: Sge, what: SendOp) -> Result<Option<Ticket>> {
        self.check()?;
        let flags = self.inline_flag(&what, sge.len() as usize);
        // SAFETY: the caller's contract.
        match unsafe { self.attempt(Sges::PerRequest(&[sge]), &[what], flags, false)? } {
            Attempt::Posted(id) => Ok(Some(Ticket::send(id))),
            Attempt::Full => Ok(None),
            // A single request is accepted or refused whole (qp.rs reports a refused first
            // request as a plain verbs error); should a device report otherwise, the accepted
            // part's flush is awaited as for any chain (blocking, on this impossible path).
            Attempt::Partial(e, accepted) => Err(self.after_partial(what.name(), e, accepted)),
        }
    }

    /// A partially accepted chain: fails the connection and waits for the accepted part's flush.
    /// Returns the post's error, or [`Error::FlushLost`] if the flush never came.
    fn after_partial(&self, op: &'static str, e: Error, accepted: u32) -> Error {
        self.fail(Failure::local(&e));
        match self.flush_marker(op, accepted) {
            Err(lost @ Error::FlushLost { .. }) => lost,
            _ => e,
        }
    }

    /// One attempt to post `sges`/`ops` as a chain ending in a signaled tail; with `reap`, a
    /// full queue is reaped once before giving up.
    ///
    /// # Safety
    /// As [`Connection::post_chain`].
    unsafe fn attempt(&self, sges: Sges<'_>, ops: &[SendOp], flags: SendFlags, reap: bool) -> Result<Attempt> {
        let k = ops.len() as u32;
        self.core.with_send(|core, slots| {
            if slots.used() + k > self.opts.send_depth {
                if !reap {
                    return Ok(Attempt::Full);
                }
                // Completions already in the CQ may free the room: look before giving up.
                slots.reap(core)?;
                if slots.used() + k > self.opts.send_depth {
                    return Ok(Attempt::Full);
                }
            }
            let first = self.next_id.fetch_add(u64::from(k), Ordering::Relaxed);
            let tail = first + u64::from(k) - 1;
            let wr = |i: usize, op: SendOp| {
                let f = if i as u32 == k - 1 { flags | SendFlags::SIGNALED } else { flags };
                SendWr { wr_id: first + i as u64, sges: sges.of(i), op, flags: f }
            };
            let r = if k == 1 {
                // The common single request: no allocation.
                let one = [wr(0, ops[0])];
                // SAFETY: the caller keeps the memory valid until the tail completes.
                unsafe { self.qp.post_send(&one) }
            } else {
                let wrs: Vec<SendWr<'_>> = ops.iter().enumerate().map(|(i, &op)| wr(i, op)).collect();
                // SAFETY: as above.
                unsafe { self.qp.post_send(&wrs) }
            };
            match r {
                Ok(()) => {
                    slots.posted(tail, k, k, ops[ops.len() - 1].name(), sges.bytes(ops.len()));
                    Ok(Attempt::Posted(tail))
                }
                Err(e @ Error::PartialPost { posted, .. }) => {
                    // The accepted requests use their memory until they complete or are
                    // flushed; none of them is signaled, so a marker will cover them.
                    slots.posted_untracked(posted as u32, sges.bytes(posted));
                    Ok(Attempt::Partial(e, posted as u32))
                }
                Err(e) => Err(e),
            }
        })
    }

    /// After a partially accepted chain (the QP already moved to the error state): posts a
    /// signaled, memory-less marker behind the `accepted` requests and waits for its flush.
    /// Send-queue completions come in order, so the marker's proves that every accepted request
    /// has completed or been flushed — unsignaled requests that completed successfully before
    /// the QP failed report nothing of their own. Returns [`Error::FlushLost`] if the marker
    /// could not be posted or flushed within [`FLUSH_WAIT`].
    fn flush_marker(&self, op: &'static str, accepted: u32) -> Result<Completed> {
        let start = Instant::now();
        let mut spins = 0;
        loop {
            let mark = self.core.mark();
            let id = self.next_wr_id();
            let marker = [SendWr { wr_id: id, sges: &[], op: SendOp::Send, flags: SendFlags::SIGNALED }];
            let posted = self.core.with_send(|core, slots| {
                // SAFETY: the marker has no memory; a QP in the error state flushes it.
                match unsafe { self.qp.post_send(&marker) } {
                    Ok(()) => {
                        slots.marker_posted(id, accepted + 1, op);
                        true
                    }
                    Err(_) => {
                        // Most likely the queue is still full: let the flush make room.
                        let _ = slots.reap(core);
                        false
                    }
                }
            });
            if posted {
                return self.wait(Ticket::send(id));
            }
            if start.elapsed() > FLUSH_WAIT {
                return Err(Error::FlushLost { wr_id: id, waited: start.elapsed() });
            }
            if self.core.pause(&mut spins, Duration::from_millis(1), mark).is_err() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Waits for `ticket`'s completion, the way the connection's [`WaitMode`] says (busy
    /// polling, the completion channel, the poller thread). Whatever goes wrong (the operation timeout, a failing
    /// `ibv_poll_cq` or completion-channel call) fails the connection and *keeps waiting* for the
    /// request's flush, so that when this returns the NIC no longer uses the request's memory —
    /// except with [`Error::FlushLost`], when the flush never came: then the caller must leak
    /// the memory (owned) or abort (borrowed).
    pub(crate) fn wait(&self, ticket: Ticket) -> Result<Completed> {
        self.usable()?;
        // The common case, a completion already there: claimed without setting up the loop
        // (the loop's first round, exactly).
        #[cfg(test)]
        if self.core.panic_in_wait.swap(false, Ordering::Relaxed) {
            panic!("injected panic while work request {} is in flight", ticket.wr_id);
        }
        match self.core.try_claim(ticket) {
            Ok(Some(o)) => {
                self.core.spin_claimed(ticket.send, None);
                self.settle(o, None)
            }
            Ok(None) => self.wait_loop(ticket, None),
            Err(e) => self.wait_loop(ticket, Some(e)),
        }
    }

    /// [`Connection::wait`] once the first look found nothing (or failed with `first`, which
    /// fails the connection as a failure found in the loop does).
    #[inline(never)]
    fn wait_loop(&self, ticket: Ticket, first: Option<Error>) -> Result<Completed> {
        let Ticket { wr_id, send } = ticket;
        // Send-queue requests are answered by the peer's NIC; receives wait for its application.
        let limit = if send { Some(self.opts.op_timeout) } else { self.opts.recv_timeout };
        // Started by the first poll that finds nothing: a completion claimed at once costs no
        // clock read. Loops that sleep read the clock on every round.
        let mut watch = self.core.stopwatch();
        // The local failure (timeout, verbs error) that made this wait fail the connection, and
        // when (on the watch).
        let mut local: Option<(Error, Duration)> = None;
        // When this wait, which has no deadline, saw the connection failed by someone else.
        let mut orphaned: Option<Duration> = None;
        let mut spins = 0u32;
        // Event mode: polls without sleeping until this much after the first miss (decided
        // then), so a fast operation never pays a channel event.
        let mut spin: Option<Duration> = None;
        if let Some(e) = first {
            let now = watch.elapsed();
            self.fail_locally(&mut local, e, now);
        }
        loop {
            let mark = self.core.mark();
            let claimed = self.core.try_claim(ticket);
            if let Ok(Some(o)) = claimed {
                self.core.spin_claimed(send, Some(&watch));
                return self.settle(o, local.map(|(e, _)| e));
            }
            let now = watch.elapsed();
            if let Err(e) = claimed {
                self.fail_locally(&mut local, e, now);
            }
            if orphaned.is_none() && local.is_none() && limit.is_none() && self.core.failure().is_some() {
                // No deadline of its own: a failure recorded elsewhere (the watcher, another
                // waiter) must flush this request within FLUSH_WAIT, or its memory is lost.
                orphaned = Some(now);
            }
            if let Some(limit) = limit.filter(|&l| local.is_none() && now > l) {
                let what = if send { "waiting for a send completion" } else { "waiting for a receive" };
                self.fail(Failure::Op { op: what, wr_id, status: WcStatus::RespTimeoutErr, vendor_err: 0 });
                local = Some((Error::Timeout(limit, "a completion"), now));
            }
            let left = match local.as_ref().map(|(_, since)| *since).or(orphaned) {
                Some(since) => {
                    let waited = now.saturating_sub(since);
                    if waited > FLUSH_WAIT {
                        return Err(Error::FlushLost { wr_id, waited });
                    }
                    FLUSH_WAIT - waited
                }
                // Without a limit, sleep in slices (a failure flushes the request and wakes it).
                None => limit.map_or(Duration::from_secs(1), |l| l.saturating_sub(now)),
            };
            let budget = *spin.get_or_insert_with(|| self.core.spin_budget(send));
            if local.is_none() && orphaned.is_none() && now < budget {
                std::hint::spin_loop();
                continue;
            }
            if budget > Duration::ZERO {
                self.core.spin_expired(send);
                spin = Some(Duration::ZERO);
            }
            if let Err(e) = self.core.pause(&mut spins, left.max(Duration::from_millis(1)), mark) {
                self.fail_locally(&mut local, e, now);
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Records a local error of the completion path: fails the connection, starts the flush wait
    /// (`now`, on the waiter's watch).
    fn fail_locally(&self, local: &mut Option<(Error, Duration)>, e: Error, now: Duration) {
        if local.is_none() {
            tracing::debug!("completion path failed ({e}); failing the connection and waiting for the flush");
            self.fail(Failure::local(&e));
            *local = Some((e, now));
        }
    }

    fn settle(&self, o: Outcome, local: Option<Error>) -> Result<Completed> {
        match (o, local) {
            (_, Some(e)) => Err(e),
            (Ok(c), None) => Ok(c),
            (Err(f), None) => Err(self.core.cause(f).error()),
        }
    }

    /// Posts one receive into `list` (empty: a receive without memory, several: scattered).
    /// Returns its ticket.
    ///
    /// # Safety
    /// The SGEs' memory must stay valid and untouched until the receive is claimed with
    /// [`Connection::wait`] (or its buffer is parked with the connection).
    pub(crate) unsafe fn post_recv_raw(&self, list: &[Sge]) -> Result<Ticket> {
        self.check()?;
        let id = self.next_wr_id();
        self.core.with_recv_slot(self.opts.recv_depth, || {
            // SAFETY: the caller keeps the memory valid until the receive is claimed.
            unsafe { self.qp.post_recv(id, list) }
        })?;
        Ok(Ticket::recv(id))
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if self.forked_copy() {
            // A fork()ed child's copy of a parent's connection: the QP, its CM id, its buffers
            // are the parent's, which keeps using them. Touch nothing (a parent thread may have
            // held one of its locks at the fork) and release nothing: the CQs, QP and MRs skip
            // their destruction here anyway, and a CM id must not be disconnected.
            std::mem::forget(std::mem::take(&mut self.kept));
            std::mem::forget(Arc::clone(&self.core));
            std::mem::forget(self.control.take());
            // Its Poller's last handle would join a thread the child does not have.
            std::mem::forget(std::mem::take(&mut self.opts));
            return;
        }
        if let Some(peer) = self.pair_peer.take().and_then(|p| p.upgrade()) {
            peer.fail(Disconnect::PeerClosed);
        }
        let flushed = self.close();
        // The counters take both queue locks: only when someone listens.
        if tracing::enabled!(target: "mralloc::transfer", tracing::Level::DEBUG) {
            let stats = self.core.stats();
            tracing::debug!(
                target: "mralloc::transfer",
                qpn = self.qp.qpn(),
                send_requests = stats.send_requests,
                send_bytes = stats.send_bytes,
                recv_requests = stats.recv_requests,
                recv_bytes = stats.recv_bytes,
                errors = stats.errors,
                failure = %self.core.failure().map(Failure::error).map_or_else(String::new, |e| e.to_string()),
                "connection closed"
            );
        }
        // Nothing watches the QP (or what `kept` holds) any more after these.
        drop(self.watch.take());
        self.link.retire();
        if flushed.is_ok() {
            // The QP is in the error state and flushed: it serves no remote access, so the
            // windows bound through it are dead, and nothing it holds is in use. Release them,
            // and deallocate the windows nobody will release (a forgotten grant's: its buffer
            // stays leaked), before destroying it: a window still bound to a QP made Soft-RoCE
            // (Linux 6.1) wait 50 s in the QP's destruction.
            drop(self.core.take_held());
            self.windows.deallocate_all();
        }
        // SAFETY: dropped once, here; nothing uses the QP afterwards. Once it is destroyed the
        // device processes none of its requests any more.
        unsafe { ManuallyDrop::drop(&mut self.qp) };
        let held = self.core.take_held();
        match flushed {
            Ok(()) => drop(held),
            Err(e) => {
                // The device may still write them: never free them (leaked before the log runs:
                // a logger may panic).
                let n = held.len();
                std::mem::forget(held);
                tracing::error!("closing a connection: {e}; leaking {n} buffers it still held");
            }
        }
    }
}
