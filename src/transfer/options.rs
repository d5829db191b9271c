//! Connection options, grouped by concern: the queue pair ([`QpOptions`]), the device
//! ([`DeviceChoice`]), setup ([`SetupOptions`]), waiting ([`WaitOptions`]), and, at the top,
//! liveness probes and the shared receive queue.

use std::time::Duration;

use crate::error::Result;
use crate::transfer::{Poller, Secret, SharedReceiver};
use crate::verbs::{Access, ConnectOptions, Context, QpCaps};

/// How a thread waiting for a completion waits.
#[derive(Debug, Clone, Default)]
pub enum WaitMode {
    /// Spin on the CQ for as long as the wait lasts: the lowest latency, and one busy core per
    /// waiting thread even while nothing arrives (an idle server burns its cores). For latency
    /// work on dedicated cores.
    BusyPoll,
    /// Poll the CQ briefly — adaptively, up to [`WaitOptions::spin`] — then sleep on the
    /// connection's completion channel until the NIC raises an event. The default: fast
    /// operations complete within the spin, and an idle wait costs no CPU.
    #[default]
    Event,
    /// Sleep until a [`Poller`] thread, which serves many connections, reports progress.
    Poller(Poller),
}

/// How a [`crate::transfer::Connection`] is set up, one group per concern; set what you mean
/// and leave the rest to `..Default::default()`:
///
/// ```
/// use mralloc::transfer::{Options, QpOptions, Secret, SetupOptions, WaitOptions};
/// use mralloc::verbs::Access;
/// use std::time::Duration;
///
/// let opts = Options {
///     qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() },
///     setup: SetupOptions {
///         secret: Some(Secret::new("a long shared secret")?),
///         connect_timeout: Duration::from_secs(5),
///         ..Default::default()
///     },
///     wait: WaitOptions { op_timeout: Duration::from_secs(5), ..Default::default() },
///     ..Default::default()
/// };
/// assert_eq!(opts.qp.send_depth, 256);
/// # Ok::<(), mralloc::Error>(())
/// ```
///
/// Defaults suit a data-center RC link.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// What the queue pair is created and connected with, and what the peer may do through it.
    /// Default: [`QpOptions::default`].
    pub qp: QpOptions,
    /// Which device, port and GID the connection uses. Default: [`DeviceChoice::default`]
    /// (`MRALLOC_DEVICE` / `MRALLOC_GID_INDEX`, or the first active device and port).
    pub device: DeviceChoice,
    /// Connection setup and its handshake: deadline, concurrency, shared secret. Default:
    /// [`SetupOptions::default`].
    pub setup: SetupOptions,
    /// How and how long threads wait for completions. Default: [`WaitOptions::default`].
    pub wait: WaitOptions,
    /// Probe the peer every this long (default `None`: no probes). Without probes, a peer
    /// whose process exits is found at once (its setup TCP stream closes, or RDMA CM reports the
    /// disconnect), but one whose host loses power, or whose path is cut, goes unnoticed while
    /// the connection is idle. A probe is a zero-length RDMA WRITE posted by mralloc's watcher
    /// thread; it names no memory, and the peer's NIC answers it without the peer's
    /// application. An unanswered probe fails the connection with
    /// [`crate::Error::Disconnected`] with [`crate::Disconnect::KeepaliveFailed`] when the
    /// transport gives up on it (`RETRY_EXC_ERR`, after the *retry time* `(qp.retry_count + 1)
    /// × 4.096 µs × 2^qp.ack_timeout`, read back from the QP — an RDMA CM connection's ACK
    /// timeout comes from its path: 0.54 s with these defaults; a device may round each retry up
    /// to its timer's tick, or run its timer up to 4 times longer) or when it has been out for
    /// `max(2 × keepalive, retry time)` (`RESP_TIMEOUT_ERR`; for devices that retry for ever,
    /// as rxe does with a retry count of 7), whichever comes first. On an idle connection, a
    /// peer gone silent is found within `keepalive + max(2 × keepalive, retry time) +
    /// min(keepalive / 4, 250 ms)` of its last answer. Choose an interval well above the path's
    /// round trip; below the retry time it only adds packets.
    ///
    /// Probes go out only while the send queue is empty: a request ahead of a probe (a SEND
    /// waiting for the peer to post a receive, a large WRITE) could hold it up with the peer
    /// alive. Requests in flight find a dead peer themselves — by the transport's retries, or
    /// by [`WaitOptions::op_timeout`] for a waiting caller; with a retry count the device takes
    /// as "for ever", a request nobody waits for any more (a dropped
    /// [`crate::transfer::Pending`]) that never completes also keeps the probes from going out.
    ///
    /// **Both ends must set it**: the probe needs the peer's QP to accept RDMA WRITE, so a
    /// connection with keepalive accepts WRITEs whatever [`QpOptions::remote_access`] says.
    /// That reaches no memory by itself — a WRITE needs a key with write rights (a buffer
    /// exposed with them, or a grant) — but a peer that learns such a key meant for another
    /// connection could use it here. A probe the peer refuses (it did not set keepalive) fails
    /// the connection with `KeepaliveFailed { status: RemInvReqErr }`, about one interval after
    /// setup. A connection whose QP the device moved to the error state without telling this
    /// side (rxe does so to the target of a bad request) fails with `KeepaliveFailed { status:
    /// WrFlushErr }` at the next probe. Zero, or more than a day, is refused
    /// ([`crate::Error::InvalidArgument`]).
    pub keepalive: Option<Duration>,
    /// Take receives from this shared receive queue instead of a receive queue per connection
    /// (servers with many peers: receive memory stays fixed). Connections set up with it
    /// refuse their own receive calls ([`Error::InvalidArgument`](crate::Error::InvalidArgument));
    /// their messages arrive through [`SharedReceiver::recv`]. It must be in the connection's
    /// PD. Async connections refuse it. Default: `None`.
    pub shared_receive: Option<SharedReceiver>,
}

/// What a connection's queue pair is created and connected with, and what the peer may do
/// through it ([`Options::qp`]).
#[derive(Debug, Clone)]
pub struct QpOptions {
    /// Send-queue depth (outstanding work requests). Default 256; the device's limit caps it
    /// ([`crate::transfer::Connection::options`] shows what was granted).
    pub send_depth: u32,
    /// Receive-queue depth (posted receives). Default 256, capped as `send_depth`.
    pub recv_depth: u32,
    /// Bytes a SEND or WRITE may carry inline (no DMA read of the source). Default 64; the
    /// device's limit caps it (0 on devices without inline data).
    pub max_inline: u32,
    /// Transport retries before `RETRY_EXC_ERR` (0-7; default 7, as perftest and RDMA CM use).
    /// Soft-RoCE (`rdma_rxe`) takes 7 as "retry forever", against the specification: there, a
    /// peer that stops answering is never reported by the transport (keepalive probes still
    /// find it, by their own deadline).
    pub retry_count: u8,
    /// ACK timeout exponent: 4.096 µs × 2^n. Default 14 (67 ms per try; with the default retry
    /// count, an unanswered request is given up after about 0.54 s).
    pub ack_timeout: u8,
    /// RNR retries (7, the default, = forever: a SEND waits for the peer to post a receive).
    pub rnr_retry: u8,
    /// What the *peer* may do into this side's memory through the connection: RDMA WRITE (and
    /// write-with-immediate), READ and atomics ([`Access::REMOTE_WRITE`],
    /// [`Access::REMOTE_READ`], [`Access::REMOTE_ATOMIC`]; other bits are ignored). Default
    /// [`Access::NONE`]: the peer can only SEND. The setup (TCP exchange, RDMA CM, a pair)
    /// tells the peer what this side grants
    /// ([`Connection::peer_grants`](crate::transfer::Connection::peer_grants) there), and the
    /// peer refuses a one-sided request this side did not grant before posting it
    /// ([`crate::Error::NotGranted`]). The side whose memory is the *target* asks: a server
    /// that offers a buffer for the client to write into needs `REMOTE_WRITE`; a client that
    /// only writes needs nothing. The memory itself must grant the right as well (its heap's
    /// access, or a [`crate::transfer::Connection::grant`]).
    pub remote_access: Access,
}

impl Default for QpOptions {
    fn default() -> QpOptions {
        QpOptions {
            send_depth: 256,
            recv_depth: 256,
            max_inline: 64,
            retry_count: 7,
            ack_timeout: 14,
            rnr_retry: 7,
            remote_access: Access::NONE,
        }
    }
}

impl QpOptions {
    /// How long the transport retries an unanswered request before `RETRY_EXC_ERR`:
    /// `(retry_count + 1) × 4.096 µs × 2^ack_timeout` (0.54 s with the defaults).
    pub(crate) fn retry_time(&self) -> Duration {
        crate::verbs::retry_time(self.ack_timeout, self.retry_count)
    }

    pub(crate) fn caps(&self) -> QpCaps {
        QpCaps {
            max_send_wr: self.send_depth,
            max_recv_wr: self.recv_depth,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: self.max_inline,
        }
    }

    pub(crate) fn connect_options(&self) -> ConnectOptions {
        ConnectOptions {
            timeout: self.ack_timeout,
            retry_cnt: self.retry_count,
            rnr_retry: self.rnr_retry,
            ..ConnectOptions::default()
        }
    }
}

/// Which device, port and GID a connection uses ([`Options::device`]); each unset one takes its
/// default.
#[derive(Debug, Clone, Default)]
pub struct DeviceChoice {
    /// Device name (default `None`: `MRALLOC_DEVICE`, else the first active device).
    pub name: Option<String>,
    /// Port (default `None`: the first active one).
    pub port: Option<u8>,
    /// GID index (default `None`: `MRALLOC_GID_INDEX`, else the RoCE v2 IPv4 entry).
    pub gid_index: Option<u32>,
}

/// How a connection is set up: the deadline, the handshakes a listener runs at once, and the
/// shared secret ([`Options::setup`]).
#[derive(Debug, Clone)]
pub struct SetupOptions {
    /// Limit on connection setup as a whole (TCP connect and the endpoint exchange; on a
    /// listener, each handshake from its TCP accept to the connection being handed to an
    /// accept call: how long a silent client can hold a handshake slot). Default 10 s.
    pub connect_timeout: Duration,
    /// TCP listeners: handshakes in flight at once (default 256; no thread each: a blocking
    /// listener's run inside its accept calls, an async listener's as tasks); further clients
    /// wait in the kernel's backlog until one ends. Bounds what silent or slow clients can hold.
    pub max_handshakes: usize,
    /// A secret both ends of a TCP setup ([`crate::transfer::Listener`],
    /// [`crate::transfer::Connection::connect`]) must hold (default `None`). With one, the
    /// exchange is a challenge-response (HMAC-SHA-256 over fresh nonces, endpoints and blobs;
    /// the secret never travels): a peer without it gets no QP and no blob, and both sides fail
    /// with [`crate::Error::Authentication`] if either lacks it or they differ. It
    /// authenticates, it does not encrypt. RDMA CM setups refuse options with a secret;
    /// [`crate::transfer::Connection::pair`] (one process) ignores it. Never printed by `Debug`.
    pub secret: Option<Secret>,
}

impl Default for SetupOptions {
    fn default() -> SetupOptions {
        SetupOptions { connect_timeout: Duration::from_secs(10), max_handshakes: 256, secret: None }
    }
}

/// How and how long threads wait for completions ([`Options::wait`]).
#[derive(Debug, Clone)]
pub struct WaitOptions {
    /// How threads wait for completions. Default [`WaitMode::Event`]: a short adaptive poll
    /// (up to [`WaitOptions::spin`]), then a sleep on the completion channel — an idle wait
    /// costs no CPU. [`WaitMode::BusyPoll`] for the lowest latency on dedicated cores.
    pub mode: WaitMode,
    /// The longest a wait polls its CQ before sleeping until the completion channel wakes it:
    /// blocking waits in [`WaitMode::Event`] (the default) and async operations
    /// (`AsyncConnection`, feature `tokio`). The poll adapts below this to how long the
    /// connection's recent operations took, and stops for operations that take longer (a
    /// receive from a quiet peer sleeps at once). Default 200 µs; zero never polls; at most
    /// 1 ms is honoured, since polling holds a thread.
    pub spin: Duration,
    /// Limit on waiting for one send-queue operation's completion (WRITE, READ, SEND, atomics)
    /// and for send-queue room; past it the connection is failed (its QP moved to the error
    /// state) so that no memory stays in the NIC's hands. A live peer's NIC answers these
    /// without its application (only a SEND waits for the peer to post a receive). Default
    /// 30 s. Async operations have no such limit (cancel their future instead).
    pub op_timeout: Duration,
    /// Limit on a blocking receive ([`crate::transfer::Connection::recv`],
    /// [`crate::transfer::Pending::wait`] on a receive): `None` (the default) waits as long as
    /// the peer stays silent — an idle peer is not a dead one. A dead peer is found without it:
    /// mralloc watches every connection's setup TCP stream or RDMA CM events and the device's
    /// events, and fails the connection with [`crate::Error::Disconnected`]. With a limit, a
    /// receive that expires fails the connection (its receive must be flushed to give the
    /// memory back).
    pub recv_timeout: Option<Duration>,
}

impl Default for WaitOptions {
    fn default() -> WaitOptions {
        WaitOptions {
            mode: WaitMode::Event,
            spin: Duration::from_micros(200),
            op_timeout: Duration::from_secs(30),
            recv_timeout: None,
        }
    }
}

impl Options {
    /// Opens the device these options name (`device.name`, else `MRALLOC_DEVICE`, else the
    /// first active one).
    ///
    /// # Errors
    /// As [`Context::open`] when `device.name` is set, else as [`Context::open_default`].
    pub fn open_device(&self) -> Result<Context> {
        match &self.device.name {
            Some(name) => Context::open(name),
            None => Context::open_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every group's defaults are the ones its fields' docs state.
    #[test]
    fn defaults_are_the_documented_ones() {
        let o = Options::default();
        let qp = &o.qp;
        assert_eq!((qp.send_depth, qp.recv_depth, qp.max_inline), (256, 256, 64));
        assert_eq!((qp.retry_count, qp.ack_timeout, qp.rnr_retry), (7, 14, 7));
        assert_eq!(qp.remote_access, Access::NONE);
        assert!(o.device.name.is_none() && o.device.port.is_none() && o.device.gid_index.is_none());
        assert_eq!((o.setup.connect_timeout, o.setup.max_handshakes), (Duration::from_secs(10), 256));
        assert!(o.setup.secret.is_none());
        assert!(matches!(o.wait.mode, WaitMode::Event));
        assert_eq!((o.wait.spin, o.wait.op_timeout), (Duration::from_micros(200), Duration::from_secs(30)));
        assert!(o.wait.recv_timeout.is_none() && o.keepalive.is_none() && o.shared_receive.is_none());
        // 4.096 µs × 2^14 × 8 tries: "about 0.54 s".
        assert_eq!(qp.retry_time().as_millis(), 536);
    }
}
