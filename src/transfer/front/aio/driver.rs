//! The task that turns completion-channel events into wake-ups, and the waiters it wakes.
//!
//! One driver task per [`crate::transfer::AsyncConnection`]: it sleeps on the completion
//! channel's file descriptor through tokio's reactor ([`AsyncFd`]), reaps what arrived (which
//! also releases the buffers of cancelled operations) and wakes every waiting future. Futures
//! re-check their own request after a wake-up; a spurious wake-up costs one look at a short list.
//!
//! **CQs are armed on demand.** An armed CQ raises an event (a reactor wake-up, a read, a
//! re-arm: several system calls) for every completion, even those a spinning future claims
//! itself. So the driver arms only while someone needs events: a future that goes to sleep,
//! a parked buffer waiting for its completion, or requests waiting in the backlog for room
//! (which the driver posts even if nobody polls them). A future that claims its completion
//! within its spin costs the driver nothing.
//!
//! No completion is missed. The driver arms, then reaps, then wakes every registered future.
//! A completion that arrives after the arm raises an event (another round); one that arrived
//! before it is reaped (or already was, by a spinning future) before the wake-up. A future
//! registers before it looks at its request, then asks for events if the CQs are not known to
//! be armed ([`Waiters::register`]); the driver marks them unarmed before it decides whether to
//! arm (a Dekker pair: one of the two sees the other), so a future that registers after that
//! decision asks for another round.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::Waker;

use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::transfer::connection::FLUSH_WAIT;
use crate::transfer::engine::completion::Failure;
use crate::transfer::front::aio::reactor::register_readable;
use crate::transfer::front::aio::Shared;
use crate::verbs::CompChannel;

/// Futures waiting for completions on one connection, and whether they will get events.
#[derive(Default)]
pub(crate) struct Waiters {
    list: Mutex<Vec<Waker>>,
    /// Whether the CQs are armed (set by the driver after arming, cleared before it decides
    /// whether to arm again).
    armed: AtomicBool,
    /// Asks the driver for a round that arms the CQs.
    want: Arc<Notify>,
}

impl Waiters {
    /// Adds `w` unless an equivalent waker is already registered, and makes sure the CQs will
    /// raise an event. The caller looks at its request once more afterwards.
    pub(crate) fn register(&self, w: &Waker) {
        {
            let mut v = self.list.lock();
            if !v.iter().any(|x| x.will_wake(w)) {
                v.push(w.clone());
            }
        }
        self.want_events();
    }

    /// Asks the driver to arm the CQs unless they are armed: someone now needs completions
    /// reaped without polling for them (a sleeping future, a parked buffer).
    pub(crate) fn want_events(&self) {
        if !self.armed.load(Ordering::SeqCst) {
            self.want.notify_one();
        }
    }

    fn is_empty(&self) -> bool {
        self.list.lock().is_empty()
    }

    /// Wakes (and forgets) every registered waker.
    pub(crate) fn wake_all(&self) {
        let woken = std::mem::take(&mut *self.list.lock());
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
    // SAFETY: the descriptor belongs to the channel inside the ChannelFd, which the AsyncFd
    // owns: it stays open, and is the same descriptor, until the AsyncFd is dropped.
    let fd = unsafe {
        register_readable(
            &handle,
            ChannelFd(channel),
            "registering a completion channel with tokio (the runtime needs I/O enabled)",
        )
    }?;
    let weak = Arc::downgrade(shared);
    shared.driver_alive.store(true, Ordering::Release);
    let want = shared.waiters.want.clone();
    handle.spawn(drive(Alive(weak), fd, stop, want));
    Ok(())
}

/// The driver's hold on its connection. When the driver task ends for any reason (the
/// connection went, or its runtime shut down and dropped the task), waiters are told: they
/// then poll the CQ themselves rather than wait for wake-ups that will not come.
struct Alive(Weak<Shared>);

impl Drop for Alive {
    fn drop(&mut self) {
        if let Some(sh) = self.0.upgrade().filter(|sh| !sh.conn().forked_copy()) {
            sh.driver_alive.store(false, Ordering::Release);
            sh.waiters.wake_all();
        }
    }
}

enum Round {
    /// The connection is gone.
    Gone,
    /// A round ran (and armed the CQs if anyone needed events).
    Done,
    /// The CQs could not be armed or polled: no event can be relied on.
    Broken(Error),
}

/// Arms both CQs if anyone needs events (see the module docs), reaps until they are empty,
/// posts what waits for room, wakes every waiter. `force` arms in any case.
fn round(weak: &Weak<Shared>, force: bool, after_event: bool) -> Round {
    let Some(sh) = weak.upgrade() else { return Round::Gone };
    let core = sh.conn().core();
    if after_event {
        // The event that woke us disarmed a CQ: cleared before the decision (see the module
        // docs). Only then: a round asked for by a future leaves the flag alone, so futures
        // woken by it that register again do not ask for round after round.
        sh.waiters.armed.store(false, Ordering::SeqCst);
    }
    let wanted = force || !sh.waiters.is_empty() || core.has_parked() || !sh.backlog.lock().is_empty();
    let mut armed = Ok(());
    if wanted {
        // Reap even if arming failed: the flush after the failure must still be collected.
        armed = {
            let (send, recv) = core.cqs();
            send.arm().and_then(|()| recv.arm())
        };
        sh.waiters.armed.store(armed.is_ok(), Ordering::SeqCst);
    }
    let r = core.drain().and(armed);
    // Reaped completions made room: post what waits for it, in order.
    sh.pump();
    sh.waiters.wake_all();
    match r {
        Ok(_) => Round::Done,
        Err(e) => Round::Broken(e),
    }
}

async fn drive(alive: Alive, fd: AsyncFd<ChannelFd>, stop: Arc<Notify>, want: Arc<Notify>) {
    let weak = &alive.0;
    let channel = &fd.get_ref().0;
    let mut after_event = false;
    loop {
        match round(weak, false, after_event) {
            Round::Gone => return,
            Round::Broken(e) => return degraded(weak, e, &stop).await,
            Round::Done => {}
        }
        let ready = tokio::select! {
            biased;
            () = stop.notified() => return,
            () = want.notified() => {
                after_event = false;
                continue;
            }
            r = fd.readable() => r,
        };
        after_event = true;
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
            return degraded(weak, e, &stop).await;
        }
    }
}

/// Without events the driver cannot sleep: it fails the connection (the device flushes every
/// outstanding request), keeps reaping, yielding between rounds, until nothing is outstanding
/// or the flush has had [`FLUSH_WAIT`] — then it stops spinning and waits for the connection to
/// go (whose drop leaks what the device never flushed).
async fn degraded(weak: &Weak<Shared>, e: Error, stop: &Notify) {
    tracing::error!("the completion path failed ({e}); failing the connection");
    match weak.upgrade() {
        Some(sh) => sh.conn().fail(Failure::local(&e)),
        None => return,
    }
    let start = std::time::Instant::now();
    loop {
        if let Round::Gone = round(weak, true, true) {
            return;
        }
        if weak.upgrade().is_none_or(|sh| sh.conn().core().quiet()) || start.elapsed() > FLUSH_WAIT {
            break;
        }
        tokio::task::yield_now().await;
    }
    stop.notified().await;
}
