//! One connection's completion state: CQs, routing of completions to their waiters, the
//! connection's failure, and the buffers of operations nobody waits for any more.
//!
//! A dropped [`crate::transfer::Pending`] *parks* its buffer here under its work-request id; the
//! buffer is released when that request's completion (or its flush, after a failure) is reaped,
//! by whichever thread reaps it. Released buffers are dropped after the state lock is let go, so
//! a buffer's own `Drop` can never deadlock against the connection. The connection watcher,
//! which reaps for keepalive probes, runs no buffer's `Drop`: what it releases waits for the
//! next reap by an application thread, or for the connection's end.
//!
//! A flush carries no cause: it reports the failure recorded before it. A flushed request's
//! waiter asks [`Core::cause`], which first reaps the other CQ (the error completion that moved
//! the QP to the error state may wait there). A flush nobody waits for — a parked buffer's,
//! a probe's, an unsignaled request's — is explained the same way when it is reaped, so a QP
//! that went to the error state without a word to this side (rxe moves a responder's QP there
//! on a bad request) still leaves its failure recorded.

mod held;
mod outcome;
mod pause;
mod queue;
mod reap;
mod slots;

pub use outcome::Completed;
pub(crate) use outcome::{Failure, Filled, Outcome};
use queue::{Lifecycle, Queue};
pub(crate) use queue::{Parked, Ticket};
pub(crate) use slots::SendSlots;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::clock::Stopwatch;
use crate::error::{Disconnect, Error, Result};
use crate::transfer::engine::spin::Spin;
use crate::verbs::{CompChannel, Cq, WcStatus, WorkCompletion};

/// Set in every receive's work-request id (their own sequence; keepalive probes have bit 63):
/// receives are told from send-queue requests in messages and errors, and no two share an id.
const RECV_BIT: u64 = 1 << 62;

/// The operation name of a keepalive probe (its completion's, and a failure's): the completion
/// path tells probes from the application's requests by it.
pub(crate) const PROBE_OP: &str = "keepalive probe";

/// Who reaps: an application thread (or a poller, or an async driver) runs released buffers'
/// `Drop`s, also those the watcher kept; a posting path runs only those it released itself (it
/// may hold a lock of its own); the connection watcher runs none (a `Drop` may block, and it
/// watches every connection).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reaper {
    App,
    Post,
    Watcher,
}

/// How a waiting thread waits for its completion.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    BusyPoll,
    Event,
    Poller,
}

/// The part of a connection that completion processing needs. Shared with a
/// [`crate::transfer::Poller`] thread when one serves the connection.
pub(crate) struct Core {
    send_cq: Cq,
    recv_cq: Cq,
    failed: OnceLock<Failure>,
    send: Mutex<Queue>,
    recv: Mutex<Queue>,
    /// Keyed buffers that may be released only once the queue pair is in the error state and
    /// flushed (grants and lent memory whose window could not be invalidated): released by the
    /// connection's drop after its close, before the queue pair is destroyed (a window still
    /// bound to it makes Soft-RoCE wait for the window when the QP is destroyed).
    until_closed: Mutex<Vec<Parked>>,
    /// Buffers released by the connection watcher, whose `Drop`s it does not run: dropped by
    /// the next reap of an application thread (or with the connection).
    deferred: Mutex<Vec<Parked>>,
    has_deferred: AtomicBool,
    /// Polls that reaped something, by any thread, in event mode (a waiter sleeping on the
    /// completion channel must not sleep over an outcome another thread reaped since it last
    /// looked: that one raises no event).
    reaps: AtomicU64,
    /// Event mode: waiters napping on `wake` while another thread sleeps on the channel.
    nappers: AtomicUsize,
    mode: Mode,
    /// Event mode: how long a blocking wait polls before it sleeps (adaptive).
    spin: Spin,
    channel: Option<CompChannel>,
    event_lock: Mutex<()>,
    wake: Condvar,
    wake_lock: Mutex<u64>,
    /// Test hook: this many coming CQ polls fail with EIO (no device fails them on demand).
    #[cfg(test)]
    pub(crate) fail_polls: std::sync::atomic::AtomicU32,
    /// Test hook: the next wait panics (after its request was posted).
    #[cfg(test)]
    pub(crate) panic_in_wait: std::sync::atomic::AtomicBool,
}

impl Core {
    /// `depths`: the send and receive queues' depths (the requests each has in flight at most).
    pub(crate) fn new(send_cq: Cq, recv_cq: Cq, depths: (u32, u32), mode: Mode, spin: Duration) -> Core {
        let channel = send_cq.channel().cloned();
        Core {
            send_cq,
            recv_cq,
            failed: OnceLock::new(),
            send: Mutex::new(Queue::new(depths.0, 1)),
            recv: Mutex::new(Queue::new(depths.1, RECV_BIT | 1)),
            until_closed: Mutex::new(Vec::new()),
            deferred: Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
            reaps: AtomicU64::new(0),
            nappers: AtomicUsize::new(0),
            mode,
            spin: Spin::new(if mode == Mode::Event { spin } else { Duration::ZERO }),
            channel,
            event_lock: Mutex::new(()),
            wake: Condvar::new(),
            wake_lock: Mutex::new(0),
            #[cfg(test)]
            fail_polls: Default::default(),
            #[cfg(test)]
            panic_in_wait: Default::default(),
        }
    }

    /// The connection's first failure, if it has failed (set once, never cleared).
    #[inline]
    pub(crate) fn failure(&self) -> Option<&Failure> {
        self.failed.get()
    }

    /// The send and receive CQs (the watcher watches their handles; the async driver arms
    /// them).
    pub(crate) fn cqs(&self) -> (&Cq, &Cq) {
        (&self.send_cq, &self.recv_cq)
    }

    /// A stopwatch for a wait on this connection: busy polling reads the clock once in
    /// [`crate::clock::BUSY`] polls, waits that sleep on every round.
    pub(crate) fn stopwatch(&self) -> Stopwatch {
        Stopwatch::new(if self.mode == Mode::BusyPoll { crate::clock::BUSY } else { 1 })
    }

    /// The completion channel the CQs raise events on (connections in event mode).
    #[cfg(feature = "tokio")]
    pub(crate) fn channel(&self) -> Option<&CompChannel> {
        self.channel.as_ref()
    }

    /// Records the first failure; returns whether this one was it.
    pub(crate) fn fail(&self, f: Failure) -> bool {
        let first = self.failed.set(f).is_ok();
        if first && !matches!(f, Failure::Closed) {
            // Called while reaping (a failed completion), where an outcome taken for its waiter
            // must not be lost to a subscriber's panic: the log runs contained.
            let _ = std::panic::catch_unwind(|| {
                tracing::debug!(target: "mralloc::transfer", "connection failed: {}", f.error());
            });
        }
        first
    }

    fn queue(&self, send: bool) -> parking_lot::MutexGuard<'_, Queue> {
        if send {
            self.send.lock()
        } else {
            self.recv.lock()
        }
    }

    /// Runs `f` on a queue's state; after the lock is gone, records a flush it reaped that
    /// nobody will explain, and drops the buffers it released (and those the watcher kept).
    #[inline(always)]
    fn with<R>(&self, send: bool, f: impl FnOnce(&Core, &mut Queue) -> R) -> R {
        self.with_as(send, Reaper::App, f)
    }

    #[inline(always)]
    fn with_as<R>(&self, send: bool, who: Reaper, f: impl FnOnce(&Core, &mut Queue) -> R) -> R {
        let mut q = self.queue(send);
        let r = f(self, &mut q);
        // The common case released nothing and reaped no flush: the lock is let go, done.
        if q.released.is_empty()
            && q.orphan.is_none()
            && !(who == Reaper::App && self.has_deferred.load(Ordering::Acquire))
        {
            return r;
        }
        self.after_reap(q, send, who);
        r
    }

    /// [`Core::with_as`]'s uncommon end: with the queue's lock let go, records a flush nobody
    /// will explain and drops the buffers released (and those the watcher kept).
    #[cold]
    #[inline(never)]
    fn after_reap(&self, mut q: parking_lot::MutexGuard<'_, Queue>, send: bool, who: Reaper) {
        let released = std::mem::take(&mut q.released);
        let orphan = q.orphan.take();
        drop(q);
        if let Some(flush) = orphan {
            self.explain(send, flush, who);
        }
        self.release(released, who);
    }

    /// Drops released buffers — or, on the watcher's thread, keeps them for an application
    /// thread to drop. An application thread's reap also drops what the watcher kept.
    fn release(&self, released: Vec<Parked>, who: Reaper) {
        if who == Reaper::Watcher {
            if !released.is_empty() {
                self.deferred.lock().extend(released);
                self.has_deferred.store(true, Ordering::Release);
            }
            return;
        }
        let mut all = released;
        if who == Reaper::App
            && self.has_deferred.load(Ordering::Acquire)
            && self.has_deferred.swap(false, Ordering::AcqRel)
        {
            all.append(&mut self.deferred.lock());
        }
        for buf in all {
            // A buffer's own Drop must not unwind through completion processing: that would skip
            // the bookkeeping that keeps the other buffers from being freed too early.
            // Nothing may unwind out of here at all: a poster reaps before its request's guard
            // exists. So the panic's payload is leaked (its own Drop could panic again) and the
            // log runs contained too (a subscriber may panic).
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(buf))) {
                std::mem::forget(payload);
                let _ = std::panic::catch_unwind(|| {
                    tracing::error!("dropping a buffer released by its completion panicked; the panic was contained");
                });
            }
        }
    }

    /// Records `flush`, reaped on the `send` (or receive) queue with no waiter to explain it,
    /// unless a failure is recorded already or turns up in the other CQ (its own CQ was reaped
    /// up to the flush: an error completion there came before it).
    fn explain(&self, send: bool, flush: Failure, who: Reaper) {
        if self.failed.get().is_none() {
            let mut q = self.queue(!send);
            // A poll that fails leaves the flush as the best explanation there is.
            let _ = self.drain_queue(!send, &mut q);
            // Flushes there are explained by what is recorded now.
            q.orphan = None;
            let released = std::mem::take(&mut q.released);
            drop(q);
            self.release(released, who);
        }
        self.fail(flush);
    }

    fn outcome(&self, wc: &WorkCompletion, op: &'static str) -> Outcome {
        if wc.is_ok() {
            Ok(Completed { byte_len: wc.byte_len(), imm: wc.imm(), opcode: wc.opcode() })
        } else {
            let f = if op == PROBE_OP {
                // The probe failed: the peer is unreachable or refuses probes (or, flushed with
                // nothing else recorded, the QP went to the error state without a word).
                Failure::Lost(Disconnect::KeepaliveFailed { status: wc.status() })
            } else {
                Failure::Op { op, wr_id: wc.wr_id(), status: wc.status(), vendor_err: wc.vendor_err() }
            };
            if wc.status() != WcStatus::WrFlushErr {
                self.fail(f);
                return Err(f);
            }
            // A flushed request reports the failure that caused the flush. Not known yet (the
            // error completion that caused it may wait in the other CQ): its waiter asks
            // [`Core::cause`], which looks there.
            Err(*self.failed.get().unwrap_or(&f))
        }
    }

    /// What a request's failure `f` is reported as: a flush reports what caused it — found by
    /// reaping both CQs if no failure is recorded yet (an error completion on the other queue,
    /// e.g. a keepalive probe's, precedes the flush it caused), else the flush itself, which
    /// is then recorded. Call without a queue's lock held.
    pub(crate) fn cause(&self, f: Failure) -> Failure {
        if !matches!(f, Failure::Op { status: WcStatus::WrFlushErr, .. }) {
            return f;
        }
        if self.failed.get().is_none() {
            // A poll that fails leaves the flush as the best explanation there is.
            let _ = self.drain();
        }
        self.fail(f);
        *self.failed.get().unwrap_or(&f)
    }

    /// The connection watcher's reap for a keepalive probe: the send CQ until it is empty,
    /// running no released buffer's `Drop` (see the module docs).
    pub(crate) fn reap_for_probe(&self) -> Result<usize> {
        let n = self.with_as(true, Reaper::Watcher, |c, q| c.drain_queue(true, q))?;
        self.wake_pollers(n);
        Ok(n)
    }

    /// A mark to hand to [`Core::pause`], taken before looking for an outcome.
    pub(crate) fn mark(&self) -> u64 {
        self.reaps.load(Ordering::SeqCst)
    }

    fn wake_pollers(&self, n: usize) {
        if n > 0 && self.mode == Mode::Poller {
            *self.wake_lock.lock() += 1;
            self.wake.notify_all();
        }
    }

    /// Reaps both CQs into the routing maps and wakes waiters if anything arrived. This is what a
    /// poller thread calls.
    pub(crate) fn progress(&self) -> Result<usize> {
        let n = self.with(true, |c, q| c.reap(true, q))? + self.with(false, |c, q| c.reap(false, q))?;
        self.wake_pollers(n);
        Ok(n)
    }

    /// Reaps both CQs until they are empty. After arming a CQ this is what must follow: a
    /// completion already queued raises no event, so one left behind would wait for the next.
    /// Bounded by the CQs' capacity: what arrives later raises an event of its own.
    pub(crate) fn drain(&self) -> Result<usize> {
        let cap = (self.send_cq.depth() + self.recv_cq.depth()) as usize;
        let mut total = 0;
        while total <= cap {
            let n = self.progress()?;
            if n == 0 {
                break;
            }
            total += n;
        }
        Ok(total)
    }

    /// Takes the outcome of `wr_id` if it has completed (reaping the CQ once if needed).
    pub(crate) fn try_claim(&self, Ticket { wr_id, send }: Ticket) -> Result<Option<Outcome>> {
        self.with(send, |c, q| {
            // Another thread's reap may have left the outcome here; if none waits, the reap
            // below hands it back directly.
            if q.tickets.any_completed() {
                if let Some(o) = q.tickets.claim(wr_id) {
                    return Ok(Some(o));
                }
            }
            c.reap_claiming(send, q, wr_id)
        })
    }

    /// Whether `wr_id` has completed, leaving its outcome for its waiter.
    pub(crate) fn is_done(&self, Ticket { wr_id, send }: Ticket) -> Result<bool> {
        self.with(send, |c, q| {
            if q.tickets.is_completed(wr_id) {
                return Ok(true);
            }
            c.reap(send, q)?;
            Ok(q.tickets.is_completed(wr_id))
        })
    }

    /// Hands `buf` to the connection until `wr_id` completes (at once if it already has).
    /// Never blocks on the NIC. Returns whether it is parked (waits for a completion not yet
    /// reaped).
    pub(crate) fn park(&self, Ticket { wr_id, send }: Ticket, buf: Parked) -> bool {
        self.with_as(send, Reaper::Post, |c, q| {
            let at = q.tickets.find(wr_id);
            match at.map(|t| (t, q.tickets.at(t))) {
                Some((t, Lifecycle::Submitted { .. })) => {
                    q.tickets.abandon(t, buf);
                    true
                }
                Some((t, Lifecycle::Completed(_))) => {
                    // A flush reaped for a waiter that is gone now: nobody else will explain it.
                    if let Lifecycle::Completed(Err(f @ Failure::Op { status: WcStatus::WrFlushErr, .. })) =
                        q.tickets.remove_at(t)
                    {
                        q.orphan = q.orphan.or(Some(f));
                    }
                    q.released.push(buf);
                    false
                }
                // Abandoned twice, or no ticket (every parked request has one): nothing says
                // when the NIC is done with it but the connection's close (its QP flushed).
                Some((_, Lifecycle::Abandoned { .. })) | None => {
                    debug_assert!(false, "parking work request {wr_id} without a submitted ticket");
                    c.until_closed.lock().push(buf);
                    true
                }
            }
        })
    }

    /// Runs `f` with the send queue locked, so that posting and slot accounting are one step.
    /// Drops only what `f` itself released by reaping (posting paths may hold locks of their
    /// own: the watcher's kept buffers wait for a reap).
    pub(crate) fn with_send<R>(&self, f: impl FnOnce(&Core, &mut SendSlots<'_>) -> R) -> R {
        self.with_as(true, Reaper::Post, |c, q| f(c, &mut SendSlots(q)))
    }

    /// [`Core::with_send`] for the connection watcher: runs no buffer's `Drop`.
    pub(crate) fn with_send_for_probe<R>(&self, f: impl FnOnce(&Core, &mut SendSlots<'_>) -> R) -> R {
        self.with_as(true, Reaper::Watcher, |c, q| f(c, &mut SendSlots(q)))
    }

    /// Posts a receive with the receive queue locked: `post` runs, with the receive's id, only
    /// if a slot is free. Returns the id.
    pub(crate) fn with_recv_slot(&self, depth: u32, post: impl FnOnce(u64) -> Result<()>) -> Result<u64> {
        self.with_as(false, Reaper::Post, |_, q| {
            if q.used >= depth {
                return Err(Error::InvalidArgument(format!(
                    "{} receives are already posted (the receive queue depth)",
                    q.used
                )));
            }
            let id = q.next_id;
            post(id)?;
            q.next_id += 1;
            q.used += 1;
            q.counts.requests += 1;
            q.tickets.submitted(id, 1, "recv");
            Ok(id)
        })
    }
}
