//! The TCP setup exchange on one stream: the stream with one deadline for the whole exchange
//! ([`Timed`]), the server side of it ([`serve`], run by a listener's handshakes), and the
//! stream kept open and watched for the connection's life ([`keep_watched`]). The client side
//! is `Connection::connect_with` (`tcp.rs`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transfer::liveness::watch::Source;
use crate::transfer::setup::auth::{self, expect};
use crate::transfer::setup::control::{Established, Prepared};
use crate::transfer::setup::exchange::{Kind, Message};
use crate::transfer::Options;
use crate::verbs::Pd;

pub(crate) fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

/// A setup stream whose reads and writes share one deadline: the whole exchange, not each
/// call, is bounded (a peer trickling one byte a second cannot stretch it).
pub(crate) struct Timed {
    s: TcpStream,
    until: Instant,
    limit: Duration,
}

impl Timed {
    pub(crate) fn new(s: TcpStream, until: Instant, limit: Duration) -> Result<Timed> {
        s.set_nodelay(true).map_err(io("setting TCP_NODELAY".into()))?;
        Ok(Timed { s, until, limit })
    }

    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let why = format!("the connection setup took longer than {:?} (SetupOptions::connect_timeout)", self.limit);
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why));
        }
        Ok(left)
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        self.s.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        self.s.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.s.flush()
    }
}

/// The server side of the exchange on an accepted TCP stream, all of it before `deadline`;
/// `blob` gives what to send (it waits for an accept call); with `control`, a control channel
/// is offered (and set up if the client offers one too).
pub(crate) fn serve(
    s: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    pd: &Pd,
    opts: &Options,
    control: bool,
    blob: impl FnOnce() -> Result<Vec<u8>>,
) -> std::result::Result<Established, Failed> {
    // Set by a step of this side's own (queue pair, connection, watcher): its failure is not
    // the client's, whatever its error type.
    let local = std::cell::Cell::new(false);
    let ours = |e: Error| {
        local.set(true);
        e
    };
    let r = (|| {
        let mut s = Timed::new(s, deadline, opts.setup.connect_timeout).map_err(ours)?;
        let x = auth::server(&mut s, opts.setup.secret.as_ref(), || {
            let blob = blob()?;
            let prepared = Prepared::new(pd, opts, control).map_err(ours)?;
            let (me, control) = prepared.endpoints();
            Ok(((prepared, me, control), blob))
        })?;
        // The client checked this side's Welcome (and MAC) before saying Ready: only then is
        // the QP connected. The client posts nothing before this side's Ready, sent once it is.
        expect(Message::recv(&mut s)?, Kind::Ready)?;
        // The client's endpoints decide whether the device accepts them (an unroutable GID is
        // refused here): the client's failure, unless this side's device is gone.
        x.prepared.connect_to(opts, &x.peer, x.peer_control.as_ref()).map_err(|e| match e {
            Error::DeviceRemoved { .. } | Error::Forked(_) => ours(e),
            e => e,
        })?;
        let mut conn = x.prepared.wrap(pd, opts, x.peer, x.peer_control, x.peer_blob).map_err(ours)?;
        Message::new(Kind::Ready, Some(x.me), Vec::new()).send(&mut s)?;
        tracing::debug!(%peer, authenticated = opts.setup.secret.is_some(), "accepted RDMA connection");
        keep_watched(&mut conn, s).map_err(ours)?;
        Ok(conn)
    })();
    r.map_err(|error| Failed { by_client: !local.get(), error })
}

/// A failed [`serve`]: the error, and whether the client caused it (its TCP connection, its
/// messages, its secret) rather than a step of this side's own.
pub(crate) struct Failed {
    pub(crate) error: Error,
    pub(crate) by_client: bool,
}

/// The connection keeps its setup stream open for life, and the watcher reads it: its closing
/// is how the peer's end going away shows here.
pub(crate) fn keep_watched(conn: &mut Established, s: Timed) -> Result<()> {
    let fd = s.s.as_raw_fd();
    conn.set_peer_addr(s.s.peer_addr().ok());
    conn.keep(s.s);
    conn.start_watch(Some(Source::Tcp(fd)))
}
