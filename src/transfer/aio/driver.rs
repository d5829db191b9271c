//! The task that turns completion-channel events into wake-ups, and the waiters it wakes.
//!
//! One driver task per [`crate::transfer::AsyncConnection`]: it keeps both CQs armed, sleeps on
//! the completion channel's file descriptor through tokio's reactor ([`AsyncFd`]), reaps what
//! arrived (which also releases the buffers of cancelled operations) and wakes every waiting
//! future. Futures re-check their own request after a wake-up; a spurious wake-up costs one
//! look at a short list.
//!
//! No completion is missed: the driver arms both CQs, then reaps, then wakes. A completion that
//! arrives after the arm raises an event (another round); one that arrived before it is reaped
//! (or already was, by a spinning future) before the wake-up, which every future registered by
//! then receives. A future registers before it looks at its request, so one that registers after
//! the wake-up finds its outcome already routed.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::task::Waker;

use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::transfer::aio::Shared;
use crate::transfer::completion::Failure;
use crate::verbs::CompChannel;

/// Futures waiting for completions on one connection.
#[derive(Default)]
pub(crate) struct Waiters(Mutex<Vec<Waker>>);

impl Waiters {
    /// Adds `w` unless an equivalent waker is already registered.
    pub(crate) fn register(&self, w: &Waker) {
        let mut v = self.0.lock();
        if !v.iter().any(|x| x.will_wake(w)) {
            v.push(w.clone());
        }
    }

    /// Wakes (and forgets) every registered waker.
    pub(crate) fn wake_all(&self) {
        let woken = std::mem::take(&mut *self.0.lock());
        for w in woken {
            w.wake();
        }
    }
}

/// The completion channel, as tokio's reactor sees it: its descriptor stays open as long as this
/// value (which holds the channel) lives.
struct ChannelFd(CompChannel);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd()
    }
}

/// Registers the connection's completion channel with the reactor and spawns the driver.
///
/// # Errors
/// [`Error::Io`] if there is no tokio runtime with I/O enabled, or the descriptor cannot be made
/// non-blocking or registered.
pub(crate) fn spawn(shared: &Arc<Shared>, channel: CompChannel, stop: Arc<Notify>) -> Result<()> {
    let handle = tokio::runtime::Handle::try_current().map_err(|e| Error::Io {
        what: "starting an async connection (it needs a tokio runtime)".into(),
        source: std::io::Error::other(e),
    })?;
    channel.set_nonblocking()?;
    let fd = {
        // AsyncFd::new registers with the reactor of the current runtime.
        let _guard = handle.enter();
        // SAFETY: the descriptor belongs to the channel inside the ChannelFd, which the AsyncFd
        // owns: it stays open, and is the same descriptor, until the AsyncFd is dropped.
        unsafe { AsyncFd::register_with_interest(ChannelFd(channel), tokio::io::Interest::READABLE) }.map_err(|e| {
            Error::Io {
                what: "registering a completion channel with tokio (the runtime needs I/O enabled)".into(),
                source: std::io::Error::other(e.to_string()),
            }
        })?
    };
    let weak = Arc::downgrade(shared);
    handle.spawn(drive(weak, fd, stop));
    Ok(())
}

/// Arms, reaps and wakes once. Returns `false` once the connection is gone.
fn round(weak: &Weak<Shared>) -> bool {
    let Some(sh) = weak.upgrade() else { return false };
    let core = &sh.conn().core;
    let armed = core.send_cq.arm().and_then(|()| core.recv_cq.arm());
    let reaped = armed.and_then(|()| core.progress());
    if let Err(e) = reaped {
        // The completion path is broken: fail the connection so the device flushes everything.
        // Waiters then keep looking for their flush (the next round, or their own polls).
        sh.conn().fail(Failure::local(&e));
    }
    sh.waiters.wake_all();
    true
}

async fn drive(weak: Weak<Shared>, fd: AsyncFd<ChannelFd>, stop: Arc<Notify>) {
    let channel = &fd.get_ref().0;
    while round(&weak) {
        let ready = tokio::select! {
            biased;
            () = stop.notified() => break,
            r = fd.readable() => r,
        };
        let drained = match ready {
            Ok(mut guard) => loop {
                // Take every pending event (each is acknowledged): an edge is reported once.
                match channel.try_event() {
                    Ok(true) => {}
                    Ok(false) => {
                        guard.clear_ready();
                        break Ok(());
                    }
                    Err(e) => break Err(e),
                }
            },
            Err(source) => Err(Error::Io { what: "waiting for a completion channel".into(), source }),
        };
        if let Err(e) = drained {
            degraded(&weak, e, &stop).await;
            break;
        }
    }
}

/// Without events the driver cannot sleep: it fails the connection (the device flushes every
/// outstanding request), keeps reaping, yielding between rounds, until nothing is outstanding,
/// then waits for the connection to go.
async fn degraded(weak: &Weak<Shared>, e: Error, stop: &Notify) {
    tracing::error!("the completion channel failed ({e}); failing the connection");
    match weak.upgrade() {
        Some(sh) => sh.conn().fail(Failure::local(&e)),
        None => return,
    }
    loop {
        if !round(weak) {
            return;
        }
        if weak.upgrade().is_none_or(|sh| sh.conn().core.quiet()) {
            break;
        }
        tokio::task::yield_now().await;
    }
    stop.notified().await;
}
