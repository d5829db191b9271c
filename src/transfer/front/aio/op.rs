//! [`Op`]: the future of one async operation, which owns its buffer until the NIC is done.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::clock::Stopwatch;
use crate::error::Error;
use crate::transfer::engine::completion::{Failure, Ticket};
use crate::transfer::front::aio::backlog::{Backlog, Cancelled};
use crate::transfer::front::aio::Shared;
use crate::transfer::request::owned::OwnedScatter;
use crate::transfer::request::received::{Posted, Received};
use crate::transfer::request::{Action, Request, SgeList};
use crate::transfer::{Completed, IoBuf, Rejected};
use crate::verbs::SendOp;

enum Stage {
    /// Waiting in the connection's backlog for send-queue room (this place).
    Queued(u64),
    Posted(Ticket),
    Finished,
}

/// While spinning, the clock is read once in this many polls (a system call where the vDSO
/// cannot read the clock, as in virtual machines whose clocksource is not the TSC).
const POLLS_PER_CLOCK_READ: u32 = 8;

fn new_watch() -> Stopwatch {
    Stopwatch::new(POLLS_PER_CLOCK_READ)
}

/// An async operation in flight. It owns the buffer until the NIC is done with it: awaited to the
/// end it gives the buffer back (also when the operation failed); dropped early (a cancelled
/// task, a `select!` that took another branch, a `timeout`) it parks the buffer with the
/// connection, which frees it when the completion or the flush is reaped. Nothing here blocks.
#[must_use = "an operation does nothing useful unless awaited; dropping it parks its buffer"]
pub struct Op<B: Send + 'static> {
    shared: Arc<Shared>,
    stage: Stage,
    buf: Option<B>,
    /// Started by the first poll that found the request not yet complete: what the adaptive
    /// spin learns from; a request complete at its first poll reads no clock.
    watch: Stopwatch,
    /// A local failure of the completion path (the connection is failed; the flush is awaited),
    /// or why the post was refused.
    /// Boxed: an `Error` is large, and the future is moved by every `.await` chain that holds
    /// it (measured: ~230 instructions of copying per operation).
    local: Option<Box<Error>>,
}

impl<B: Send + 'static> std::fmt::Debug for Op<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stage = match self.stage {
            Stage::Queued(t) => format!("waiting for send-queue room (place {t})"),
            Stage::Posted(Ticket { wr_id, send }) => {
                format!("posted wr_id {wr_id} ({})", if send { "send" } else { "recv" })
            }
            Stage::Finished => "finished".into(),
        };
        f.debug_struct("Op").field("stage", &stage).finish()
    }
}

// The future never hands out pinned references to its fields: moving it is fine.
impl<B: Send + 'static> Unpin for Op<B> {}

impl Op<NoBytes> {
    /// Starts a memory-less request of the connection's own (a window bind or invalidation).
    pub(crate) fn control(shared: Arc<Shared>, op: SendOp) -> Op<NoBytes> {
        match shared.conn().request(Action::Control(op), SgeList::Empty) {
            Ok(req) => Op::start(shared, NoBytes, req),
            Err(e) => Op::refused(shared, NoBytes, e),
        }
    }
}

impl<B: Send + 'static> Op<B> {
    /// Starts `req` on `buf`: posted at once if the send queue has room and no earlier request
    /// waits for it; else queued behind them. A refused post finishes the future with the error
    /// and the buffer.
    pub(crate) fn start(shared: Arc<Shared>, buf: B, req: Request) -> Op<B> {
        let mut op = Op { shared, stage: Stage::Finished, buf: Some(buf), watch: new_watch(), local: None };
        let sh: &Shared = &op.shared;
        let conn = sh.conn();
        // SAFETY (both posts): the request's memory is `op.buf`, owned by this future from here
        // on: it is given back only after the completion was claimed, parked with the connection
        // (released when the completion is reaped) if the future is dropped, or leaked.
        let posted = if req.is_recv() {
            unsafe { conn.try_submit(&req) }.map(|t| t.expect("a receive is posted or refused"))
        } else {
            // Behind waiting requests, or without room (`Ok(None)`): queue.
            let attempt = |backlog: &Backlog| {
                if backlog.is_empty() {
                    unsafe { conn.try_submit(&req) }
                } else {
                    Ok(None)
                }
            };
            let mut backlog = sh.backlog.lock();
            let mut now = attempt(&backlog);
            if matches!(now, Ok(None)) && backlog.is_empty() {
                // No room: completions not yet reaped may make some. Reaping may free
                // buffers, so not under the backlog's lock.
                drop(backlog);
                let _ = conn.core().drain();
                backlog = sh.backlog.lock();
                now = attempt(&backlog);
            }
            match now {
                Ok(Some(ticket)) => Ok(ticket),
                Err(e) => Err(e),
                Ok(None) => {
                    op.stage = Stage::Queued(backlog.push(req));
                    drop(backlog);
                    // Room comes from reaping: the driver must reap (and post) even if
                    // nobody polls this operation.
                    sh.waiters.want_events();
                    sh.pump();
                    return op;
                }
            }
        };
        match posted {
            Ok(ticket) => op.stage = Stage::Posted(ticket),
            Err(e) => op.refuse(e),
        }
        op
    }

    /// A future that fails at once with `error`, giving `buf` back.
    pub(crate) fn refused(shared: Arc<Shared>, buf: B, error: Error) -> Op<B> {
        Op { shared, stage: Stage::Finished, buf: Some(buf), watch: new_watch(), local: Some(Box::new(error)) }
    }

    /// The post was refused: the future finishes with `e` (and the buffer, unless a chain's
    /// flush was lost: then the NIC may still use it, and it is leaked).
    fn refuse(&mut self, e: Error) {
        if let Error::FlushLost { .. } = e {
            std::mem::forget(self.buf.take());
        }
        self.stage = Stage::Finished;
        self.local = Some(Box::new(e));
    }

    fn finish(
        &mut self,
        outcome: std::result::Result<Completed, Error>,
    ) -> Poll<std::result::Result<(B, Completed), Rejected<B>>> {
        self.stage = Stage::Finished;
        let buf = self.buf.take().expect("an Op holds its buffer until it finishes");
        Poll::Ready(match outcome {
            Ok(c) => Ok((buf, c)),
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        })
    }
}

/// Without a driver (its runtime is gone) nobody wakes us, nor the waiters whose completions
/// we reap: reap, post what waits, wake everyone, and poll again soon.
pub(crate) fn no_driver(sh: &Shared, cx: &Context<'_>) {
    if sh.driver_alive.load(Ordering::Acquire) {
        return;
    }
    let _ = sh.conn().core().drain();
    sh.pump();
    sh.waiters.wake_all();
    cx.waker().wake_by_ref();
}

impl<B: Send + 'static> Future for Op<B> {
    type Output = std::result::Result<(B, Completed), Rejected<B>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            match this.stage {
                Stage::Finished => {
                    let e = this
                        .local
                        .take()
                        .map_or_else(|| Error::InvalidArgument("an Op polled after it finished".into()), |e| *e);
                    if this.buf.is_none() {
                        return Poll::Ready(Err(Rejected { error: e, buf: None }));
                    }
                    return this.finish(Err(e));
                }
                Stage::Queued(place) => {
                    // Register first: room freed (and our post, by someone else) wakes us.
                    let sh: &Shared = &this.shared;
                    sh.waiters.register(cx.waker());
                    let _ = sh.conn().core().drain();
                    sh.pump();
                    let mine = sh.backlog.lock().take(place);
                    match mine {
                        Some(Ok(ticket)) => this.stage = Stage::Posted(ticket),
                        Some(Err(e)) => this.refuse(e),
                        None => {
                            no_driver(&this.shared, cx);
                            return Poll::Pending;
                        }
                    }
                }
                Stage::Posted(ticket) => {
                    let send = ticket.send;
                    let sh: &Shared = &this.shared;
                    let conn = sh.conn();
                    // Only the first poll that finds the request incomplete spins; a poll after a
                    // wake-up looks once and sleeps again.
                    let budget = if this.watch.started() { Duration::ZERO } else { sh.spin.budget(send) };
                    let mut registered = false;
                    let r = loop {
                        match conn.core().try_claim(ticket) {
                            Ok(Some(o)) => {
                                if let Some(waited) = this.watch.exact() {
                                    sh.spin.observe(send, waited);
                                }
                                sh.spin.claimed(send);
                                break match (o, this.local.take()) {
                                    (_, Some(e)) => Err(*e),
                                    (Ok(c), None) => Ok(c),
                                    (Err(f), None) => Err(conn.core().cause(f).error()),
                                };
                            }
                            Ok(None) => {}
                            Err(e) => {
                                // The CQ cannot be polled: fail the connection so the device
                                // flushes this request, and report this error once it has.
                                if this.local.is_none() {
                                    conn.fail(Failure::local(&e));
                                    this.local = Some(Box::new(e));
                                }
                            }
                        }
                        if registered {
                            no_driver(sh, cx);
                            return Poll::Pending;
                        }
                        // The first miss starts the watch; it reads the clock once in
                        // POLLS_PER_CLOCK_READ polls.
                        let waited = this.watch.elapsed();
                        if budget.is_zero() || waited >= budget {
                            if !budget.is_zero() {
                                // Futures polled next on this queue sleep at once, until a
                                // completion is claimed: no spin after spin on a quiet queue.
                                sh.spin.expire(send);
                            }
                            // Register, then look once more: a completion routed in between
                            // was reaped before the wake-up we would otherwise miss.
                            sh.waiters.register(cx.waker());
                            registered = true;
                        } else {
                            std::hint::spin_loop();
                        }
                    };
                    return this.finish(r);
                }
            }
        }
    }
}

impl<B: Send + 'static> Drop for Op<B> {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        if !matches!(self.stage, Stage::Finished) && self.shared.conn().forked_copy() {
            // A fork()ed child's copy of a parent's operation: the backlog's and the queues'
            // locks may have been held by a parent thread at the fork. The request is the
            // parent's; this copy of its buffer is never touched by the NIC, and is left alone.
            return std::mem::forget(buf);
        }
        let ticket = match self.stage {
            Stage::Posted(ticket) => ticket,
            Stage::Queued(place) => {
                // Under the backlog's lock: no pump can post the request after this.
                let cancelled = self.shared.backlog.lock().cancel(place);
                match cancelled {
                    Cancelled::NotPosted => return drop(buf),
                    Cancelled::Posted(ticket) => ticket,
                    Cancelled::Lost => return std::mem::forget(buf),
                }
            }
            Stage::Finished => return drop(buf),
        };
        if self.shared.conn().core().park(ticket, Box::new(buf)) {
            // The parked buffer is freed when its completion is reaped: the driver must see it.
            self.shared.waiters.want_events();
        }
    }
}

/// The buffer of a request that carries no bytes (a receive for an immediate only, a window's
/// bind or invalidation).
pub(crate) struct NoBytes;

// SAFETY: no bytes: the range is empty, so there is nothing to keep valid or to write.
unsafe impl IoBuf for NoBytes {
    fn stable_ptr(&self) -> *const u8 {
        std::ptr::NonNull::dangling().as_ptr()
    }
    fn bytes_len(&self) -> usize {
        0
    }
    fn lkey_for(&self, _: &crate::verbs::Pd) -> Option<u32> {
        None
    }
}

/// An [`Op`] whose caller wants only the buffer back (WRITE, SEND): the completion dropped.
/// A plain future rather than an `async` block around the op, which would copy the op into a
/// state machine of its own.
pub(crate) struct BufferBack<B: Send + 'static>(pub(crate) Op<B>);

impl<B: Send + 'static> Future for BufferBack<B> {
    type Output = std::result::Result<B, Rejected<B>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map(|r| r.map(|(b, _)| b))
    }
}

/// A READ's or receive's [`Op`], interpreted against what was `posted`
/// ([`Completed::delivered`]): once it completes, what the NIC wrote is recorded in the target
/// ([`filled`]; a scatter list's parts in order). A plain future, not an `async` block (which
/// would copy the op).
pub(crate) struct Delivered<B: OwnedScatter> {
    op: Op<B>,
    posted: Posted,
}

impl<B: OwnedScatter> Delivered<B> {
    /// `op`, whose request was posted as `posted`.
    pub(crate) fn new(op: Op<B>, posted: Posted) -> Delivered<B> {
        Delivered { op, posted }
    }
}

impl<B: OwnedScatter> Future for Delivered<B> {
    type Output = std::result::Result<(B, Received), Rejected<B>>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let posted = self.posted;
        std::pin::Pin::new(&mut self.op).poll(cx).map(|done| filled(done, posted))
    }
}

/// [`Delivered`] for a READ: the target back, the completion's details dropped.
pub(crate) struct TargetBack<B: OwnedScatter>(pub(crate) Delivered<B>);

impl<B: OwnedScatter> Future for TargetBack<B> {
    type Output = std::result::Result<B, Rejected<B>>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|r| r.map(|(b, _)| b))
    }
}

fn filled<B: OwnedScatter>(
    done: std::result::Result<(B, Completed), Rejected<B>>,
    posted: Posted,
) -> std::result::Result<(B, Received), Rejected<B>> {
    let (mut b, c) = done?;
    // SAFETY: `c` is the successful completion of the request the operation posted into `b`,
    // as `posted`.
    match unsafe { c.deliver_into(&mut b, posted, Some(B::filled)) } {
        Ok(got) => Ok((b, got)),
        Err(error) => Err(Rejected { error, buf: Some(b) }),
    }
}
