//! Keepalive probes ([`Options::keepalive`](crate::transfer::Options::keepalive)): what finds a
//! peer whose host, NIC or path died without a word.
//!
//! A peer process that exits closes its setup TCP stream or disconnects its CM id, and the
//! connection watcher hears of it at once. A peer *host* that loses power, or a cut cable, says
//! nothing: an idle connection would wait forever. With keepalive, the liveness thread posts a
//! zero-length RDMA WRITE on the connection every `keepalive`. It names no memory on either side (a
//! zero-length request's remote key is not checked), so it costs one packet and its ACK. The peer's
//! NIC answers it without its application; an unreachable one does not, and the transport retries
//! it `qp.retry_count` times, `4.096 µs × 2^qp.ack_timeout` apart, before completing it with
//! `RETRY_EXC_ERR`. That completion — or the probe being out for its deadline, for devices that
//! retry for ever — fails the connection with
//! [`Disconnect::KeepaliveFailed`](crate::Disconnect::KeepaliveFailed); the QP is moved to the
//! error state, so every waiter gets its flush.
//!
//! The deadline is two intervals, and never shorter than the transport's nominal retry time
//! (read back from the QP): a probe that a lost packet delays is retransmitted, not taken for a
//! dead peer — unless the device's timer runs well past nominal (the specification allows 4x)
//! and the interval is short.
//!
//! A probe goes out only on an empty send queue. Requests ahead of it could hold it up for any time
//! with the peer alive — a SEND waiting for the peer to post a receive (RNR retries), a large WRITE
//! on a slow link — and its deadline would take that for a dead peer. Requests in flight are probes
//! of their own: they complete, or fail by the same transport retries (or by their blocking
//! waiter's [`WaitOptions::op_timeout`](crate::transfer::WaitOptions::op_timeout)). A request that
//! never completes — the transport retrying for ever (rxe at retry count 7) with nobody waiting
//! under a deadline (an abandoned `Pending`, an async operation) — keeps the probes in, and a dead
//! peer is then not found by keepalive.
//!
//! Nobody waits for a probe: whichever thread reaps its completion drops it. The watcher
//! reaps the send CQ itself while a probe is out, since an idle application polls nothing. A
//! flushed probe with no failure recorded means the QP went to the error state without a word
//! to this side (rxe does that to a responder's QP on a bad request): that is the failure.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Disconnect, Result};
use crate::transfer::engine::completion::{Core, Failure};
use crate::transfer::request::Request;
use crate::verbs::{SendWr, WcStatus};

/// Probe work-request ids have the top bit set; a connection's own ids count up from 1.
const PROBE_BIT: u64 = 1 << 63;

/// The longest keepalive interval accepted.
pub(crate) const MAX_KEEPALIVE: Duration = Duration::from_secs(24 * 60 * 60);

/// The longest the watcher waits between looks at a probe in flight.
const MAX_RECHECK: Duration = Duration::from_millis(250);

/// A connection's keepalive schedule.
pub(crate) struct Keepalive {
    interval: Duration,
    recheck: Duration,
    /// How long a probe may be out before the peer is taken for dead.
    deadline: Duration,
    state: Mutex<Probe>,
}

struct Probe {
    next_id: u64,
    /// The probe out now, if any, and when it was posted.
    in_flight: Option<(u64, Instant)>,
    /// When the next probe goes out.
    due: Instant,
    /// The connection failed: nothing more to do.
    over: bool,
}

/// What a tick asks of the connection's link.
pub(crate) enum Tick {
    /// Look again at this instant.
    At(Instant),
    /// The connection failed (through the probe or otherwise): move its QP to the error state
    /// (idempotent) and stop probing.
    Failed,
}

impl Keepalive {
    /// Probes every `interval` on a connection whose transport gives up on an unanswered
    /// request after `retry_time`.
    pub(crate) fn new(interval: Duration, retry_time: Duration) -> Keepalive {
        Keepalive {
            interval,
            recheck: (interval / 4).clamp(Duration::from_millis(10), MAX_RECHECK),
            deadline: (2 * interval).max(retry_time),
            state: Mutex::new(Probe { next_id: 0, in_flight: None, due: Instant::now() + interval, over: false }),
        }
    }

    /// Stops the schedule, after a tick under way (which may still post, or keep released
    /// buffers for the connection) is over: the connection is about to destroy its QP.
    pub(crate) fn retire(&self) {
        self.state.lock().over = true;
    }

    /// Runs the schedule at `now`: looks at the probe in flight (reaping the send CQ for it),
    /// posts the next one when due. `post` posts a memory-less request on the connection's QP
    /// and says whether it did (`false`: the QP is gone). It runs with the send queue's lock
    /// held, so that the slot is accounted for in the same step.
    ///
    /// Returns `None` once the connection has failed and that was reported.
    pub(crate) fn tick(
        &self,
        core: &Core,
        now: Instant,
        post: impl FnOnce(&SendWr<'_>) -> Result<bool>,
    ) -> Option<Tick> {
        let mut st = self.state.lock();
        if st.over {
            return None;
        }
        if let Some((id, posted)) = st.in_flight {
            if let Err(e) = core.reap_for_probe() {
                core.fail(Failure::local(&e));
            }
            if core.failure().is_none() && core.send_in_flight(id) {
                let deadline = posted + self.deadline;
                if now < deadline {
                    return Some(Tick::At((now + self.recheck).min(deadline)));
                }
                // Out past its deadline: a device that retries for ever (rxe with a retry
                // count of 7) would never report the peer; this does.
                core.fail(Failure::Lost(Disconnect::KeepaliveFailed { status: WcStatus::RespTimeoutErr }));
            }
            st.in_flight = None;
        }
        if core.failure().is_some() {
            st.over = true;
            return Some(Tick::Failed);
        }
        if now < st.due {
            return Some(Tick::At(st.due));
        }
        // Completions nobody reaped (an abandoned request's, say) would keep the queue looking
        // busy for ever: reap them first.
        if let Err(e) = core.reap_for_probe() {
            core.fail(Failure::local(&e));
        }
        let id = PROBE_BIT | st.next_id;
        st.next_id = (st.next_id + 1) & !PROBE_BIT;
        let probe = Request::probe();
        let wr = probe.wr(id, true).expect("a send-queue request");
        let posted = core.with_send_for_probe(|core, slots| {
            // Only on an empty send queue (see the module docs).
            if core.failure().is_some() || slots.used() > 0 {
                return Ok(false);
            }
            let posted = post(&wr)?;
            if posted {
                slots.probe_posted(id);
            }
            Ok(posted)
        });
        match posted {
            Ok(true) => {
                // Timed from the post itself: `now` may be a while old (other links' ticks).
                let now = Instant::now();
                st.in_flight = Some((id, now));
                st.due = now + self.interval;
                Some(Tick::At(now + self.recheck))
            }
            Ok(false) => {
                // Requests in flight (or the QP gone): look again soon.
                st.due = now + self.recheck;
                Some(Tick::At(st.due))
            }
            Err(e) => {
                // A QP that refuses a post is in the error state or worse.
                core.fail(Failure::local(&e));
                st.over = true;
                Some(Tick::Failed)
            }
        }
    }
}
