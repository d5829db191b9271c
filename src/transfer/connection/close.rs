//! How a connection ends: failed (first failure wins, the QP goes to the error state), closed
//! (flushed, its parked buffers released), dropped (closed, then its QP destroyed).

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Disconnect, Error, Result};
use crate::transfer::connection::FLUSH_WAIT;
use crate::transfer::engine::completion::Failure;
use crate::transfer::Connection;
use crate::verbs::QpState;

impl Connection {
    /// Closes the connection: moves the QP to the error state (later posts fail with
    /// [`Error::Closed`], or with the failure that came first), waits for the device to flush
    /// every outstanding request, and frees the buffers of operations nobody waits for.
    /// Operations other threads still wait for complete with the flush error and give their
    /// buffers back. Dropping a connection closes it.
    ///
    /// # Errors
    /// [`Error::FlushLost`] (with `wr_id` 0) if the device did not flush within a few seconds, or
    /// the queue pair is not seen in the error state once nothing is outstanding (a device
    /// fault, or the queue pair could not be moved there — that failure itself is not reported):
    /// dropping the connection waits once more, and leaks the buffers still held if the flush
    /// has not come by then. Closing twice is not an error.
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
                return self.in_error_state(start);
            }
            if start.elapsed() > FLUSH_WAIT {
                return Err(Error::FlushLost { wr_id: 0, waited: start.elapsed() });
            }
            if self.core.pause(&mut spins, Duration::from_millis(1), mark).is_err() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Whether the QP is seen in the error state (or its device is gone), once nothing is
    /// outstanding: a QP that could not be moved there has nothing outstanding either, yet its
    /// bound windows still serve the peer.
    ///
    /// # Errors
    /// [`Error::FlushLost`] (with `wr_id` 0) if the QP is in another state or cannot be asked.
    fn in_error_state(&self, start: Instant) -> Result<()> {
        match self.qp.state() {
            Ok(QpState::Error) => Ok(()),
            _ if self.pd.context().is_removed() => Ok(()),
            _ => Err(Error::FlushLost { wr_id: 0, waited: start.elapsed() }),
        }
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
