//! Async RDMA on tokio (feature `tokio`): [`AsyncConnection`] (operations as futures over owned
//! buffers), [`AsyncListener`] and [`AsyncCmListener`], and what they share — the
//! per-connection driver task, the cancel-safe operation future [`Op`], the adaptive poll, the
//! atomics' landing words, and registration with tokio's reactor.

mod backlog;
mod cm_listener;
mod connection;
mod control;
mod driver;
mod lending;
mod listener;
mod op;
mod rails_lending;
mod reactor;
mod remote;
mod scratch;
mod wire;

use std::mem::ManuallyDrop;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use parking_lot::Mutex;

use tokio::sync::Notify;

use crate::transfer::Connection;

pub use cm_listener::AsyncCmListener;
pub use connection::AsyncConnection;
pub(crate) use lending::check_lending_heap;
pub use lending::{RemoteLimits, RemoteMemory, RemoteMemoryStats};
pub use listener::AsyncListener;
pub(crate) use rails_lending::RailsLending;
pub use rails_lending::RailsRemoteMemory;

/// What every handle and in-flight operation of one async connection shares.
pub(crate) struct Shared {
    /// Dropped in `Drop`, possibly on the blocking pool.
    conn: ManuallyDrop<Connection>,
    waiters: driver::Waiters,
    spin: crate::transfer::engine::spin::Spin,
    words: Arc<scratch::Words>,
    /// Ends the driver task.
    stop: Arc<Notify>,
    /// Whether the driver task runs (it stops if its runtime shuts down): without it, futures
    /// poll the CQ themselves instead of sleeping.
    driver_alive: AtomicBool,
    /// Send-queue requests waiting for room, posted strictly in call order.
    backlog: Mutex<backlog::Backlog>,
    /// The control channel (remote memory), if both sides set one up.
    control: Option<Arc<control::ControlShared>>,
    /// Dropped with this value: ends the control channel's tasks.
    control_stop: Option<tokio::sync::watch::Sender<()>>,
}

impl Shared {
    pub(crate) fn conn(&self) -> &Connection {
        &self.conn
    }

    /// Posts `req` now if no earlier request waits for send-queue room (call order is kept)
    /// and the queue has room; `Ok(None)` otherwise.
    ///
    /// # Safety
    /// As [`Connection::submit`].
    pub(crate) unsafe fn try_post(
        &self,
        req: &crate::transfer::request::Request,
    ) -> crate::Result<Option<crate::transfer::engine::completion::Ticket>> {
        // Before the lock: a fork()ed child's copy may find it held for good.
        self.conn.usable()?;
        let backlog = self.backlog.lock();
        if !backlog.is_empty() {
            return Ok(None);
        }
        // SAFETY: the caller's contract.
        unsafe { self.conn.try_submit(req) }
    }

    /// Wakes `w` when a completion is reaped (or, without a driver, soon: see `no_driver`).
    pub(crate) fn wake_on_completion(&self, cx: &std::task::Context<'_>) {
        self.waiters.register(cx.waker());
        op::no_driver(self, cx);
    }

    /// A buffer was parked: the driver must reap for it to be released.
    pub(crate) fn parked(&self) {
        self.waiters.want_events();
    }

    /// Posts the waiting send-queue requests that have room now, in call order, and wakes the
    /// waiters if any was posted or refused. Reap first (not under the backlog's lock: reaping
    /// may drop released buffers) for the room to be seen.
    pub(crate) fn pump(&self) {
        // SAFETY: every queued request belongs to a live Op that cancels its place under the
        // backlog's lock before dropping its memory.
        let moved = unsafe { self.backlog.lock().pump(&self.conn) };
        if moved {
            self.waiters.wake_all();
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.conn.forked_copy() {
            // A fork()ed child's copy of a parent's connection: the parent's threads may have
            // held the locks below (and the tokio primitives' own) at the fork. Touch none;
            // the connection's own drop leaves a child's copy alone.
            std::mem::forget(self.control_stop.take());
            // SAFETY: taken once, here; nothing uses it afterwards.
            drop(unsafe { ManuallyDrop::take(&mut self.conn) });
            return;
        }
        self.stop.notify_one();
        drop(self.control_stop.take());
        // SAFETY: taken once, here; nothing uses it afterwards.
        let conn = unsafe { ManuallyDrop::take(&mut self.conn) };
        if let Some(cs) = &self.control {
            // What is still lent is reachable until the queue pair is flushed (the drop below closes it).
            let lent = cs.take_lent();
            if !lent.is_empty() {
                conn.core().park_until_closed(Box::new(lent));
            }
        }
        // Closing waits for the device to flush what is outstanding, and destroying the QP, CQs
        // and registrations are system calls: not on an executor thread.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn_blocking(move || drop(conn));
            return;
        }
        drop(conn);
    }
}
