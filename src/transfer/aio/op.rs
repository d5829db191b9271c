//! [`Op`]: the future of one async operation, which owns its buffer until the NIC is done.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::error::Error;
use crate::transfer::aio::Shared;
use crate::transfer::completion::Failure;
use crate::transfer::{Completed, IoBuf, Rejected};
use crate::verbs::{SendOp, Sge};

/// What is still to be posted.
#[derive(Clone, Copy)]
pub(crate) struct Request {
    pub(crate) op: &'static str,
    /// `None`: no memory (a receive for an immediate only).
    pub(crate) sge: Option<Sge>,
    /// `None`: a receive.
    pub(crate) what: Option<SendOp>,
}

// SAFETY: the only raw pointers a Request can hold are those of `SendOp::BindMw` (a window and a
// region): handles of verbs objects, which are thread-safe, read by `ibv_post_send` only. (The
// async front end builds no binds.) Everything else is plain data.
unsafe impl Send for Request {}

enum Stage {
    /// Waiting for send-queue room.
    Unposted(Request),
    Posted {
        wr_id: u64,
        send: bool,
        at: Instant,
    },
    Finished,
}

/// An async operation in flight. It owns the buffer until the NIC is done with it: awaited to the
/// end it gives the buffer back (also when the operation failed); dropped early (a cancelled
/// task, a `select!` that took another branch, a `timeout`) it parks the buffer with the
/// connection, which frees it when the completion or the flush is reaped. Nothing here blocks.
#[must_use = "an operation does nothing useful unless awaited; dropping it parks its buffer"]
pub struct Op<B: IoBuf> {
    shared: Arc<Shared>,
    stage: Stage,
    buf: Option<B>,
    /// A local failure of the completion path (the connection is failed; the flush is awaited).
    local: Option<Error>,
}

impl<B: IoBuf> std::fmt::Debug for Op<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stage = match self.stage {
            Stage::Unposted(r) => format!("unposted {}", r.op),
            Stage::Posted { wr_id, send, .. } => {
                format!("posted wr_id {wr_id} ({})", if send { "send" } else { "recv" })
            }
            Stage::Finished => "finished".into(),
        };
        f.debug_struct("Op").field("stage", &stage).finish()
    }
}

// The future never hands out pinned references to its fields: moving it is fine.
impl<B: IoBuf> Unpin for Op<B> {}

impl<B: IoBuf> Op<B> {
    /// Starts `req` on `buf`: posted at once if there is room, else on the first poll with room.
    /// A refused post finishes the future with the error and the buffer.
    pub(crate) fn start(shared: Arc<Shared>, buf: B, req: Request) -> Op<B> {
        let mut op = Op { shared, stage: Stage::Unposted(req), buf: Some(buf), local: None };
        let _ = op.try_post();
        op
    }

    /// A future that fails at once with `error`, giving `buf` back.
    pub(crate) fn refused(shared: Arc<Shared>, buf: B, error: Error) -> Op<B> {
        Op { shared, stage: Stage::Finished, buf: Some(buf), local: Some(error) }
    }

    /// Tries to post an unposted request. `false`: no send-queue room yet. A refused post
    /// finishes the future (the error is kept for the next poll, which gives the buffer back).
    fn try_post(&mut self) -> bool {
        let Stage::Unposted(req) = self.stage else { return true };
        let conn = self.shared.conn();
        // SAFETY: the request's memory is `self.buf`, owned by this future from here on: it is
        // given back only after the completion was claimed, parked with the connection (released
        // when the completion is reaped) if the future is dropped, or leaked.
        let posted = match req.what {
            Some(what) => unsafe { conn.try_post_one(req.op, req.sge.unwrap_or(Sge::new(0, 0, 0)), what) },
            None => unsafe { conn.post_recv_raw(req.sge) }.map(Some),
        };
        match posted {
            Ok(Some(wr_id)) => {
                self.stage = Stage::Posted { wr_id, send: req.what.is_some(), at: Instant::now() };
                true
            }
            Ok(None) => false,
            Err(e) => {
                if let Error::FlushLost { .. } = e {
                    // Part of a chain was accepted and never flushed: the NIC may still use the
                    // memory, so it is leaked, never handed back.
                    std::mem::forget(self.buf.take());
                }
                // Otherwise nothing was posted: the buffer comes back untouched.
                self.stage = Stage::Finished;
                self.local = Some(e);
                true
            }
        }
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

impl<B: IoBuf> Future for Op<B> {
    type Output = std::result::Result<(B, Completed), Rejected<B>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            match this.stage {
                Stage::Finished => {
                    let e = this
                        .local
                        .take()
                        .unwrap_or_else(|| Error::InvalidArgument("an Op polled after it finished".into()));
                    if this.buf.is_none() {
                        return Poll::Ready(Err(Rejected { error: e, buf: None }));
                    }
                    return this.finish(Err(e));
                }
                Stage::Unposted(_) => {
                    // Register first: room freed after the attempt wakes us.
                    this.shared.waiters.register(cx.waker());
                    if !this.try_post() {
                        return Poll::Pending;
                    }
                }
                Stage::Posted { wr_id, send, at } => {
                    let sh = this.shared.clone();
                    let conn = sh.conn();
                    let until = at + sh.spin.budget(send);
                    let mut registered = false;
                    loop {
                        match conn.core.try_claim(wr_id, send) {
                            Ok(Some(o)) => {
                                sh.spin.observe(send, at.elapsed());
                                let r = match (o, this.local.take()) {
                                    (_, Some(e)) => Err(e),
                                    (Ok(c), None) => Ok(c),
                                    (Err(f), None) => Err(f.error()),
                                };
                                return this.finish(r);
                            }
                            Ok(None) => {}
                            Err(e) => {
                                // The CQ cannot be polled: fail the connection so the device
                                // flushes this request, and report this error once it has.
                                if this.local.is_none() {
                                    conn.fail(Failure::local(&e));
                                    this.local = Some(e);
                                }
                            }
                        }
                        if registered {
                            return Poll::Pending;
                        }
                        if Instant::now() >= until {
                            // Register, then look once more: a completion routed in between
                            // was reaped before the wake-up we would otherwise miss.
                            sh.waiters.register(cx.waker());
                            registered = true;
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                }
            }
        }
    }
}

impl<B: IoBuf> Drop for Op<B> {
    fn drop(&mut self) {
        if let (Stage::Posted { wr_id, send, .. }, Some(buf)) = (&self.stage, self.buf.take()) {
            self.shared.conn().core.park(*wr_id, *send, Box::new(buf));
        }
    }
}
