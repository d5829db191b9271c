//! `Connection`: one RC queue pair with its CQs, completion routing and failure state.

use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::transfer::{Options, WaitMode};
use crate::verbs::{
    Access, CompChannel, Cq, Endpoint, Pd, Qp, RegisteredBuf, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};

/// What a successful completion reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completed {
    /// Bytes received (receives) or transferred.
    pub byte_len: u32,
    /// Immediate data, if the peer attached some.
    pub imm: Option<u32>,
    /// The completion's opcode.
    pub opcode: WcOpcode,
}

/// The first failure of a connection; every later post reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Failure {
    pub(crate) op: &'static str,
    pub(crate) wr_id: u64,
    pub(crate) status: WcStatus,
    pub(crate) vendor_err: u32,
}

impl Failure {
    pub(crate) fn error(&self) -> Error {
        Error::Operation { op: self.op, wr_id: self.wr_id, status: self.status, vendor_err: self.vendor_err }
    }
}

/// What [`Error::Timeout`] names when a failed connection's flush never arrived.
pub(crate) const FLUSH_LOST: &str = "the flush of a failed connection";

pub(crate) type Outcome = std::result::Result<Completed, Failure>;

/// A few (id, value) pairs: completions are claimed quickly, so these stay tiny and a linear
/// scan beats hashing on the hot path.
struct Small<T>(Vec<(u64, T)>);

impl<T> Default for Small<T> {
    fn default() -> Small<T> {
        Small(Vec::with_capacity(8))
    }
}

impl<T> Small<T> {
    fn insert(&mut self, id: u64, v: T) {
        self.0.push((id, v));
    }
    fn remove(&mut self, id: u64) -> Option<T> {
        let i = self.0.iter().position(|(k, _)| *k == id)?;
        Some(self.0.swap_remove(i).1)
    }
}

struct SendState {
    /// Completions reaped but not yet claimed by their waiter.
    done: Small<Outcome>,
    /// Send-queue slots in use (posted, not yet retired by a completion).
    used: u32,
    /// For each signaled request: how many slots its completion retires, and its operation.
    tails: Small<(u32, &'static str)>,
    /// Reused poll buffer.
    wcs: [WorkCompletion; 8],
}

impl Default for SendState {
    fn default() -> SendState {
        SendState {
            done: Small::default(),
            used: 0,
            tails: Small::default(),
            wcs: std::array::from_fn(|_| WorkCompletion::empty()),
        }
    }
}

struct RecvState {
    done: Small<Outcome>,
    posted: u32,
    wcs: [WorkCompletion; 8],
}

impl Default for RecvState {
    fn default() -> RecvState {
        RecvState { done: Small::default(), posted: 0, wcs: std::array::from_fn(|_| WorkCompletion::empty()) }
    }
}

/// How a waiting thread waits for its completion.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    BusyPoll,
    Event,
    Poller,
}

/// The part of a connection that completion processing needs: CQs, routing state, failure.
/// Shared with a [`crate::transfer::Poller`] thread when one serves the connection.
pub(crate) struct Core {
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) failed: OnceLock<Failure>,
    send: Mutex<SendState>,
    recv: Mutex<RecvState>,
    mode: Mode,
    channel: Option<CompChannel>,
    event_lock: Mutex<()>,
    wake: Condvar,
    wake_lock: Mutex<u64>,
}

impl Core {
    /// Records the first failure; returns whether this one was it.
    fn fail(&self, f: Failure) -> bool {
        let first = self.failed.set(f).is_ok();
        if first {
            tracing::debug!("connection failed: {}", f.error());
        }
        first
    }

    fn outcome(&self, wc: &WorkCompletion, op: &'static str) -> Outcome {
        if wc.is_ok() {
            Ok(Completed { byte_len: wc.byte_len(), imm: wc.imm(), opcode: wc.opcode() })
        } else {
            let f = Failure { op, wr_id: wc.wr_id(), status: wc.status(), vendor_err: wc.vendor_err() };
            self.fail(f);
            // A flushed request reports the failure that caused the flush.
            Err(if wc.status() == WcStatus::WrFlushErr { *self.failed.get().unwrap_or(&f) } else { f })
        }
    }

    fn reap_send(&self, st: &mut SendState) -> Result<usize> {
        let n = self.send_cq.poll(&mut st.wcs)?;
        for i in 0..n {
            let id = st.wcs[i].wr_id();
            let (retired, op) = st.tails.remove(id).unwrap_or((1, "send-queue request"));
            st.used = st.used.saturating_sub(retired);
            let o = self.outcome(&st.wcs[i], op);
            st.done.insert(id, o);
        }
        Ok(n)
    }

    fn reap_recv(&self, st: &mut RecvState) -> Result<usize> {
        let n = self.recv_cq.poll(&mut st.wcs)?;
        for i in 0..n {
            st.posted = st.posted.saturating_sub(1);
            let o = self.outcome(&st.wcs[i], "recv");
            st.done.insert(st.wcs[i].wr_id(), o);
        }
        Ok(n)
    }

    /// Reaps both CQs into the routing maps and wakes waiters if anything arrived. This is what a
    /// poller thread calls.
    pub(crate) fn progress(&self) -> Result<usize> {
        let n = self.reap_send(&mut self.send.lock())? + self.reap_recv(&mut self.recv.lock())?;
        if n > 0 && self.mode == Mode::Poller {
            *self.wake_lock.lock() += 1;
            self.wake.notify_all();
        }
        Ok(n)
    }

    /// Takes the outcome of `wr_id` if it has completed (reaping the CQ once if needed).
    pub(crate) fn try_claim(&self, wr_id: u64, send: bool) -> Result<Option<Outcome>> {
        if send {
            let mut st = self.send.lock();
            if let Some(o) = st.done.remove(wr_id) {
                return Ok(Some(o));
            }
            self.reap_send(&mut st)?;
            Ok(st.done.remove(wr_id))
        } else {
            let mut st = self.recv.lock();
            if let Some(o) = st.done.remove(wr_id) {
                return Ok(Some(o));
            }
            self.reap_recv(&mut st)?;
            Ok(st.done.remove(wr_id))
        }
    }

    /// Puts an outcome taken by [`Core::try_claim`] back for its waiter.
    pub(crate) fn unclaim(&self, wr_id: u64, send: bool, o: Outcome) {
        if send {
            self.send.lock().done.insert(wr_id, o);
        } else {
            self.recv.lock().done.insert(wr_id, o);
        }
    }

    /// Waits a little for progress, the way the connection's mode says: spin, sleep on the
    /// completion channel, or sleep until the poller thread signals.
    fn pause(&self, spins: &mut u32, max: Duration) -> Result<()> {
        match self.mode {
            Mode::BusyPoll => {
                *spins = spins.wrapping_add(1);
                if *spins % 256 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            Mode::Event => {
                let Some(ch) = &self.channel else { return Ok(()) };
                // One thread sleeps on the channel at a time; others nap briefly.
                let Some(_g) = self.event_lock.try_lock() else {
                    std::thread::sleep(Duration::from_micros(50));
                    return Ok(());
                };
                self.send_cq.arm()?;
                self.recv_cq.arm()?;
                // Completions that arrived before arming raise no event: collect them now.
                if self.progress()? == 0 {
                    ch.wait(max.min(Duration::from_millis(100)))?;
                }
            }
            Mode::Poller => {
                let mut g = self.wake_lock.lock();
                // Bounded: a wake-up that raced this wait costs at most a millisecond.
                self.wake.wait_for(&mut g, max.min(Duration::from_millis(1)));
            }
        }
        Ok(())
    }
}

/// A reliable connection to one peer. Operations are in [`crate::transfer`]'s `ops`, `pending`
/// and `batch` modules; this type owns the queue pair and routes completions to their waiters.
///
/// Once any operation fails (a failed completion, or a timeout), the QP is in the error state and
/// every later post fails fast with the original error.
pub struct Connection {
    pub(crate) qp: Qp,
    pub(crate) pd: Pd,
    pub(crate) peer: Endpoint,
    pub(crate) peer_blob: Vec<u8>,
    pub(crate) opts: Options,
    pub(crate) core: Arc<Core>,
    next_id: AtomicU64,
    /// 8-byte landing zone for atomics' old values.
    pub(crate) scratch: Mutex<RegisteredBuf>,
    pub(crate) _tcp: Option<TcpStream>,
    /// RDMA CM objects (connections made with `connect_cm` / `CmListener`).
    pub(crate) _cm: Option<crate::transfer::cm::CmHold>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("local", &self.qp.endpoint())
            .field("peer", &self.peer)
            .field("failed", &self.core.failed.get())
            .finish()
    }
}

impl Connection {
    /// Creates the QP (INIT) and CQs for a connection in `pd`.
    pub(crate) fn prepare(pd: &Pd, opts: &Options) -> Result<(Qp, Cq, Cq)> {
        let ctx = pd.context();
        let (send_cq, recv_cq) = if matches!(opts.wait, WaitMode::Event) {
            let ch = CompChannel::new(ctx)?;
            (Cq::with_channel(ctx, opts.send_depth + 8, &ch)?, Cq::with_channel(ctx, opts.recv_depth + 8, &ch)?)
        } else {
            (Cq::new(ctx, opts.send_depth + 8)?, Cq::new(ctx, opts.recv_depth + 8)?)
        };
        let mut b = Qp::builder(pd, &send_cq, &recv_cq).caps(opts.caps());
        if let Some(p) = opts.port {
            b = b.port(p);
        }
        if let Some(g) = opts.gid_index {
            b = b.gid_index(g);
        }
        Ok((b.build()?, send_cq, recv_cq))
    }

    /// Connects a prepared QP to `peer` (RTR, RTS) and wraps it.
    pub(crate) fn finish(
        pd: &Pd,
        opts: &Options,
        (qp, send_cq, recv_cq): (Qp, Cq, Cq),
        peer: Endpoint,
        peer_blob: Vec<u8>,
        tcp: Option<TcpStream>,
    ) -> Result<Connection> {
        qp.connect(&peer, &opts.connect_options())?;
        let mut conn = Connection::wrap(pd, opts, (qp, send_cq, recv_cq), peer, peer_blob)?;
        conn._tcp = tcp;
        Ok(conn)
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
        let channel = send_cq.channel().cloned();
        let core = Arc::new(Core {
            send_cq,
            recv_cq,
            failed: OnceLock::new(),
            send: Mutex::new(SendState::default()),
            recv: Mutex::new(RecvState::default()),
            mode,
            channel,
            event_lock: Mutex::new(()),
            wake: Condvar::new(),
            wake_lock: Mutex::new(0),
        });
        if let WaitMode::Poller(p) = &opts.wait {
            p.serve(&core);
        }
        Ok(Connection {
            qp,
            pd: pd.clone(),
            peer,
            peer_blob,
            opts,
            core,
            next_id: AtomicU64::new(1),
            scratch: Mutex::new(scratch),
            _tcp: None,
            _cm: None,
        })
    }

    /// Two connections in `pd` connected to each other on one device (loopback): what a single
    /// process needs to exercise both sides.
    pub fn pair(pd: &Pd, opts: &Options) -> Result<(Connection, Connection)> {
        let a = Connection::prepare(pd, opts)?;
        let b = Connection::prepare(pd, opts)?;
        let (ea, eb) = (a.0.endpoint(), b.0.endpoint());
        let a = Connection::finish(pd, opts, a, eb, Vec::new(), None)?;
        let b = Connection::finish(pd, opts, b, ea, Vec::new(), None)?;
        Ok((a, b))
    }

    /// The PD local memory must be registered in.
    pub fn pd(&self) -> &Pd {
        &self.pd
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
        self.core.failed.get().map(Failure::error)
    }

    pub(crate) fn check(&self) -> Result<()> {
        match self.core.failed.get() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }

    pub(crate) fn next_wr_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Fails the connection (first failure wins) and moves the QP to the error state, so the
    /// NIC flushes everything outstanding.
    fn fail(&self, f: Failure) {
        if self.core.fail(f) {
            let _ = self.qp.set_error();
        }
    }

    /// Posts `wrs` (the last one signaled) as one chain, waiting for send-queue room first.
    /// Returns the id of the signaled tail.
    ///
    /// # Safety
    /// As [`Qp::post_send`]: the memory behind every SGE must stay valid and untouched until the
    /// tail's completion has been claimed with [`Connection::wait_send`].
    pub(crate) unsafe fn post_chain(
        &self,
        op: &'static str,
        sges: &[Sge],
        ops: &[SendOp],
        flags: SendFlags,
    ) -> Result<u64> {
        debug_assert_eq!(sges.len(), ops.len());
        let k = ops.len() as u32;
        if k == 0 || k > self.opts.send_depth {
            return Err(Error::InvalidArgument(format!("a chain holds 1..={} requests", self.opts.send_depth)));
        }
        let start = Instant::now();
        loop {
            self.check()?;
            {
                let mut st = self.core.send.lock();
                if st.used + k <= self.opts.send_depth {
                    let first = self.next_id.fetch_add(u64::from(k), Ordering::Relaxed);
                    let tail = first + u64::from(k) - 1;
                    fn wr(first: u64, k: u32, flags: SendFlags, i: usize, op: SendOp, sge: &Sge) -> SendWr<'_> {
                        let f = if i as u32 == k - 1 { flags | SendFlags::SIGNALED } else { flags };
                        let list: &[Sge] = if sge.is_empty() { &[] } else { std::slice::from_ref(sge) };
                        SendWr { wr_id: first + i as u64, sges: list, op, flags: f }
                    }
                    if k == 1 {
                        // The common single request: no allocation.
                        let one = [wr(first, k, flags, 0, ops[0], &sges[0])];
                        // SAFETY: the caller keeps the memory valid until the tail completes.
                        unsafe { self.qp.post_send(&one)? };
                    } else {
                        let wrs: Vec<SendWr<'_>> = ops
                            .iter()
                            .zip(sges)
                            .enumerate()
                            .map(|(i, (&op, sge))| wr(first, k, flags, i, op, sge))
                            .collect();
                        // SAFETY: as above.
                        unsafe { self.qp.post_send(&wrs)? };
                    }
                    st.used += k;
                    st.tails.insert(tail, (k, op));
                    return Ok(tail);
                }
                self.core.reap_send(&mut st)?;
            }
            if start.elapsed() > self.opts.op_timeout {
                return Err(Error::Timeout(self.opts.op_timeout, "send-queue room"));
            }
            self.core.pause(&mut 0, Duration::from_millis(1))?;
        }
    }

    /// Waits for the completion of the signaled send request `wr_id`.
    ///
    /// On timeout the connection is failed (QP → error) and the flush completion is awaited, so
    /// that when this returns the NIC no longer uses the request's memory.
    pub(crate) fn wait_send(&self, wr_id: u64) -> Result<Completed> {
        self.wait(wr_id, true)
    }

    /// [`Connection::wait_send`] for requests on *borrowed* memory: if the NIC never releases
    /// it (no flush after the QP was failed — a driver bug), returning would hand memory the NIC
    /// may still write back to safe code. That is the one case where the process is aborted.
    pub(crate) fn wait_send_borrowed(&self, wr_id: u64) -> Result<Completed> {
        self.wait_borrowed(wr_id, true)
    }

    /// Receive counterpart of [`Connection::wait_send_borrowed`].
    pub(crate) fn wait_recv_borrowed(&self, wr_id: u64) -> Result<Completed> {
        self.wait_borrowed(wr_id, false)
    }

    fn wait_borrowed(&self, wr_id: u64, send: bool) -> Result<Completed> {
        match self.wait(wr_id, send) {
            Err(Error::Timeout(_, FLUSH_LOST)) => {
                eprintln!(
                    "mralloc: the RDMA device did not flush work request {wr_id} after its queue pair was                      moved to the error state; its borrowed memory may still be written: aborting"
                );
                std::process::abort();
            }
            r => r,
        }
    }

    /// Waits for the receive `wr_id`.
    pub(crate) fn wait_recv(&self, wr_id: u64) -> Result<Completed> {
        self.wait(wr_id, false)
    }

    fn wait(&self, wr_id: u64, send: bool) -> Result<Completed> {
        let start = Instant::now();
        let mut timed_out = false;
        let mut spins = 0u32;
        loop {
            if let Some(o) = self.try_claim(wr_id, send)? {
                return match o {
                    Ok(c) if !timed_out => Ok(c),
                    Ok(_) => Err(Error::Timeout(self.opts.op_timeout, "a completion")),
                    Err(_) if timed_out => Err(Error::Timeout(self.opts.op_timeout, "a completion")),
                    Err(f) => Err(f.error()),
                };
            }
            let waited = start.elapsed();
            if !timed_out && waited > self.opts.op_timeout {
                timed_out = true;
                let what = if send { "waiting for a send completion" } else { "waiting for a receive" };
                self.fail(Failure { op: what, wr_id, status: WcStatus::RespTimeoutErr, vendor_err: 0 });
            }
            if timed_out && waited > self.opts.op_timeout + Duration::from_secs(5) {
                // The flush never came: the memory may still be the NIC's. Callers that own
                // memory leak it rather than free it.
                return Err(Error::Timeout(self.opts.op_timeout, FLUSH_LOST));
            }
            let left = (self.opts.op_timeout + Duration::from_secs(5)).saturating_sub(waited);
            self.core.pause(&mut spins, left)?;
        }
    }

    /// Takes the outcome of `wr_id` if it has completed.
    pub(crate) fn try_claim(&self, wr_id: u64, send: bool) -> Result<Option<Outcome>> {
        self.core.try_claim(wr_id, send)
    }

    /// Puts an outcome back for its waiter.
    pub(crate) fn unclaim(&self, wr_id: u64, send: bool, o: Outcome) {
        self.core.unclaim(wr_id, send, o)
    }

    /// Posts one receive. Returns its id.
    ///
    /// # Safety
    /// The SGE's memory must stay valid and untouched until the receive is claimed with
    /// [`Connection::wait_recv`].
    pub(crate) unsafe fn post_recv_raw(&self, sge: Option<Sge>) -> Result<u64> {
        self.check()?;
        let mut st = self.core.recv.lock();
        if st.posted >= self.opts.recv_depth {
            return Err(Error::InvalidArgument(format!(
                "{} receives are already posted (the receive queue depth)",
                st.posted
            )));
        }
        let id = self.next_wr_id();
        let list: &[Sge] = match &sge {
            Some(s) => std::slice::from_ref(s),
            None => &[],
        };
        // SAFETY: the caller keeps the memory valid until the receive is claimed.
        unsafe { self.qp.post_recv(id, list)? };
        st.posted += 1;
        Ok(id)
    }
}
