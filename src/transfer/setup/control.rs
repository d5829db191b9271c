//! The control channel's queue pair: a second, small RC connection set up together with the
//! data one (its endpoint travels in the same exchange), on which async connections exchange
//! remote-memory messages without consuming the application's receives.
//!
//! Both sides must ask for it: a side that does not (a blocking [`Connection`]) sends no control
//! endpoint, and neither side then creates one.

use crate::error::Result;
use crate::transfer::liveness::watch::Source;
use crate::transfer::{Connection, Options, QpOptions, SetupOptions, WaitMode, WaitOptions};
use crate::verbs::{Access, ConnectOptions, Cq, Endpoint, Pd, Qp};

/// Depth of the control channel's send and receive queues: the most control messages one side
/// has in flight (a sender beyond it waits: receiver-not-ready retries forever).
pub(crate) const DEPTH: u32 = 32;

/// The control channel's options, derived from the data connection's: small queues, events,
/// no remote rights, retried forever while the peer's receives are busy.
pub(crate) fn options(opts: &Options) -> Options {
    Options {
        qp: QpOptions {
            send_depth: DEPTH,
            recv_depth: DEPTH,
            max_inline: 64,
            rnr_retry: 7,
            remote_access: Access::NONE,
            ..opts.qp.clone()
        },
        wait: WaitOptions { mode: WaitMode::Event, ..opts.wait.clone() },
        setup: SetupOptions { secret: None, ..opts.setup.clone() },
        shared_receive: None,
        // The data connection's probes cover the path and the peer.
        keepalive: None,
        ..opts.clone()
    }
}

/// Test hook: the next server-side handshake's QP connect fails, as a device refusing the
/// client's endpoint makes it (`handshake::serve` meets it).
#[cfg(test)]
pub(crate) static REFUSE_CLIENT_ENDPOINT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Test hook: holds the `n`th connect step to start ([`Prepared::connecting`]) until released
/// (at most 20 s), so a test can look at what goes on meanwhile.
#[cfg(test)]
// Only the tokio handshakes' test holds a step.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) mod hold {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    static AT: AtomicUsize = AtomicUsize::new(0);
    static SEEN: AtomicUsize = AtomicUsize::new(0);
    static HELD: AtomicBool = AtomicBool::new(false);
    static RELEASED: AtomicBool = AtomicBool::new(false);

    /// Holds the `n`th step from now on (1-based).
    pub(crate) fn arm(n: usize) {
        SEEN.store(0, Ordering::SeqCst);
        RELEASED.store(false, Ordering::SeqCst);
        AT.store(n, Ordering::SeqCst);
    }

    /// Whether the armed step is being held now.
    pub(crate) fn held() -> bool {
        HELD.load(Ordering::SeqCst)
    }

    /// Lets the held step go on (and disarms).
    pub(crate) fn release() {
        AT.store(0, Ordering::SeqCst);
        RELEASED.store(true, Ordering::SeqCst);
    }

    pub(super) fn step() {
        if SEEN.fetch_add(1, Ordering::SeqCst) + 1 != AT.load(Ordering::SeqCst) {
            return;
        }
        HELD.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while !RELEASED.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(1));
        }
        HELD.store(false, Ordering::SeqCst);
    }
}

/// A connection as setup made it: the data connection and, when both sides offered one, its
/// control channel — which only the async front end drives: a blocking connection has none,
/// and the blocking type knows nothing of it.
pub(crate) struct Established {
    conn: Connection,
    control: Option<Connection>,
}

impl Established {
    /// Starts watching both (see [`Connection::start_watch`]); `source` is the setup stream or
    /// CM channel the data connection keeps.
    pub(crate) fn start_watch(&mut self, source: Option<Source>) -> Result<()> {
        self.conn.start_watch(source, self.control.as_ref())
    }

    /// Records the peer's IP address and port (see [`Connection::peer_addr`]).
    pub(crate) fn set_peer_addr(&mut self, addr: Option<std::net::SocketAddr>) {
        self.conn.set_peer_addr(addr);
    }

    /// Keeps `x` (a TCP stream, CM objects) with the data connection.
    pub(crate) fn keep(&mut self, x: impl Send + Sync + 'static) {
        self.conn.keep(x);
    }

    /// Ties two ends of a pair, and their control channels.
    pub(crate) fn tie(a: &mut Established, b: &mut Established) {
        Connection::tie(&mut a.conn, &mut b.conn);
        if let (Some(x), Some(y)) = (a.control.as_mut(), b.control.as_mut()) {
            Connection::tie(x, y);
        }
    }

    /// The blocking front end's connection (it offered no control channel, so there is none).
    pub(crate) fn into_blocking(self) -> Connection {
        debug_assert!(self.control.is_none(), "a blocking setup offered no control channel");
        self.conn
    }

    /// The data connection and its control channel, for the async front end.
    #[cfg(feature = "tokio")]
    pub(crate) fn into_parts(self) -> (Connection, Option<Connection>) {
        (self.conn, self.control)
    }
}

/// How the data QP and the control channel's connect, from the options.
struct ConnectAs {
    data: ConnectOptions,
    /// None without a control channel.
    control: Option<ConnectOptions>,
}

impl ConnectAs {
    fn of(opts: &Options, control: bool) -> ConnectAs {
        ConnectAs { data: opts.qp.connect_options(), control: control.then(|| options(opts).qp.connect_options()) }
    }
}

/// A data QP with its CQs and, if asked for, the control channel's.
pub(crate) struct Prepared {
    pub(crate) data: (Qp, Cq, Cq),
    pub(crate) control: Option<(Qp, Cq, Cq)>,
}

impl Prepared {
    /// Creates the QPs (INIT) and CQs.
    pub(crate) fn new(pd: &Pd, opts: &Options, control: bool) -> Result<Prepared> {
        let data = Connection::prepare(pd, opts)?;
        let control = if control { Some(Connection::prepare(pd, &options(opts))?) } else { None };
        Ok(Prepared { data, control })
    }

    /// What the exchange sends: the data endpoint and the control endpoint, if any.
    pub(crate) fn endpoints(&self) -> (Endpoint, Option<Endpoint>) {
        (self.data.0.endpoint(), self.control.as_ref().map(|c| c.0.endpoint()))
    }

    /// The rights this side grants the peer, as the exchange announces them: those its data QP
    /// was built with ([`Connection::prepare`] sets them, from [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access) and
    /// keepalive's WRITE).
    pub(crate) fn grants(&self) -> Access {
        self.data.0.remote_access()
    }

    /// Connects the data QP to `peer` and, when both sides offered one, the control QP to
    /// `peer_control`; wraps them.
    pub(crate) fn finish(
        self,
        pd: &Pd,
        opts: &Options,
        peer: Endpoint,
        peer_control: Option<Endpoint>,
        peer_blob: Vec<u8>,
        peer_grants: Access,
    ) -> Result<Established> {
        self.connect_to(opts, &peer, peer_control.as_ref())?;
        self.wrap(pd, opts, peer, peer_control, peer_blob, peer_grants)
    }

    /// The step of [`Prepared::finish`] that the peer's endpoints decide: the QPs to RTR/RTS
    /// towards them (a device refuses an unroutable GID here).
    pub(crate) fn connect_to(&self, opts: &Options, peer: &Endpoint, peer_control: Option<&Endpoint>) -> Result<()> {
        self.connect_with(&ConnectAs::of(opts, self.control.is_some()), peer, peer_control)
    }

    /// [`Prepared::connect_to`] as a step that owns the QPs and gives them back with its
    /// outcome, for a driver to run where it runs blocking work
    /// ([`Socket::run_blocking`](crate::transfer::setup::wire::Socket::run_blocking)).
    pub(crate) fn connecting(
        self,
        opts: &Options,
        peer: Endpoint,
        peer_control: Option<Endpoint>,
    ) -> impl FnOnce() -> (Prepared, Result<()>) + Send + 'static {
        let how = ConnectAs::of(opts, self.control.is_some());
        move || {
            #[cfg(test)]
            hold::step();
            let connected = self.connect_with(&how, &peer, peer_control.as_ref());
            (self, connected)
        }
    }

    fn connect_with(&self, how: &ConnectAs, peer: &Endpoint, peer_control: Option<&Endpoint>) -> Result<()> {
        self.data.0.connect(peer, &how.data)?;
        if let (Some(mine), Some(theirs), Some(how)) = (&self.control, peer_control, &how.control) {
            mine.0.connect(theirs, how)?;
        }
        Ok(())
    }

    /// The rest of [`Prepared::finish`], this side's own: the connected QPs become a
    /// connection (and its control channel, when both sides offered one). `peer_grants`: the
    /// rights the peer announced for its data QP.
    pub(crate) fn wrap(
        self,
        pd: &Pd,
        opts: &Options,
        peer: Endpoint,
        peer_control: Option<Endpoint>,
        peer_blob: Vec<u8>,
        peer_grants: Access,
    ) -> Result<Established> {
        let conn = Connection::wrap(pd, opts, self.data, peer, peer_blob, peer_grants)?;
        let control = match (self.control, peer_control) {
            (Some(mine), Some(theirs)) => {
                // Both sides build their control QP from `options`, which grants nothing: the
                // peer's grants what this side's does.
                let grants = mine.0.remote_access();
                Some(Connection::wrap(pd, &options(opts), mine, theirs, Vec::new(), grants)?)
            }
            _ => None,
        };
        Ok(Established { conn, control })
    }
}

impl Connection {
    /// As [`Connection::pair`], each end with a control channel if `control`.
    pub(crate) fn pair_with(pd: &Pd, opts: &Options, control: bool) -> Result<(Established, Established)> {
        let a = Prepared::new(pd, opts, control)?;
        let b = Prepared::new(pd, opts, control)?;
        let ((ea, ca), (eb, cb)) = (a.endpoints(), b.endpoints());
        let (ga, gb) = (a.grants(), b.grants());
        let mut a = a.finish(pd, opts, eb, cb, Vec::new(), gb)?;
        let mut b = b.finish(pd, opts, ea, ca, Vec::new(), ga)?;
        // One process: the device's events, and each end's drop, tell the other.
        Established::tie(&mut a, &mut b);
        a.start_watch(None)?;
        b.start_watch(None)?;
        Ok((a, b))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::transfer::{DeviceChoice, Secret};

    /// The control channel takes its own queue sizes, wait mode and rights, and keeps the data
    /// connection's transport timing, device, deadlines and limits.
    #[test]
    fn the_control_channel_keeps_the_data_connections_timing_and_device() {
        let data = Options {
            qp: QpOptions {
                send_depth: 1000,
                max_inline: 0,
                retry_count: 3,
                ack_timeout: 9,
                rnr_retry: 2,
                remote_access: Access::REMOTE_WRITE,
                ..Default::default()
            },
            device: DeviceChoice { name: Some("dev1".into()), port: Some(2), gid_index: Some(3) },
            setup: SetupOptions {
                connect_timeout: Duration::from_secs(3),
                max_handshakes: 5,
                secret: Some(Secret::new("k").unwrap()),
            },
            wait: WaitOptions {
                mode: WaitMode::BusyPoll,
                spin: Duration::from_micros(7),
                op_timeout: Duration::from_secs(4),
                recv_timeout: Some(Duration::from_secs(6)),
            },
            keepalive: Some(Duration::from_secs(1)),
            shared_receive: None,
        };
        let c = options(&data);
        assert_eq!((c.qp.send_depth, c.qp.recv_depth, c.qp.max_inline, c.qp.rnr_retry), (DEPTH, DEPTH, 64, 7));
        assert_eq!(c.qp.remote_access, Access::NONE);
        assert_eq!((c.qp.retry_count, c.qp.ack_timeout), (3, 9), "the data connection's transport timing");
        assert_eq!((c.device.name.as_deref(), c.device.port, c.device.gid_index), (Some("dev1"), Some(2), Some(3)));
        assert_eq!((c.setup.connect_timeout, c.setup.max_handshakes), (Duration::from_secs(3), 5));
        assert!(c.setup.secret.is_none() && c.keepalive.is_none() && c.shared_receive.is_none());
        assert!(matches!(c.wait.mode, WaitMode::Event));
        assert_eq!((c.wait.spin, c.wait.op_timeout), (Duration::from_micros(7), Duration::from_secs(4)));
        assert_eq!(c.wait.recv_timeout, Some(Duration::from_secs(6)));
    }
}
