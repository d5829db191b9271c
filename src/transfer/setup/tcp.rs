//! Connection setup over TCP: endpoints (and an optional application blob) are exchanged with a
//! small versioned message (authenticated when
//! [`SetupOptions::secret`](crate::transfer::SetupOptions::secret) is set: see the `auth` module),
//! then both QPs go to RTS and confirm with a `Ready` message before either side may post.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transfer::setup::acceptor::{deadline_after, no_answer, Accepting, HandshakeFailure, Reply};
use crate::transfer::setup::auth::{self, expect};
use crate::transfer::setup::control::{Established, Prepared};
use crate::transfer::setup::exchange::{Kind, Message};
use crate::transfer::setup::handshake::{io, keep_watched, Timed};
use crate::transfer::{Connection, Options};
use crate::verbs::Pd;

/// Accepts RDMA connections whose endpoints arrive over TCP.
///
/// Handshakes run in the background, several at once (up to
/// [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes)), each bounded
/// as a whole by [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout):
/// a slow or silent client delays nobody else. A client whose exchange reached the point where this
/// side must answer waits for an accept call; its queue pair is created only then.
///
/// ```no_run
/// use mralloc::transfer::{Listener, Options};
/// # let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
/// let listener = Listener::bind("127.0.0.1:7471", &pd, Options::default())?;
/// let conn = listener.accept()?;
/// println!("peer sent {} bytes of blob", conn.peer_blob().len());
/// # Ok::<(), mralloc::Error>(())
/// ```
pub struct Listener {
    addr: SocketAddr,
    accepting: Arc<Accepting>,
    acceptor: Option<std::thread::JoinHandle<()>>,
    /// A fork()ed child has no acceptor thread to stop.
    born: crate::fork::Born,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("addr", &self.addr).field("handshakes", &self.accepting.in_flight()).finish()
    }
}

impl Listener {
    /// Listens on `addr` for connections in `pd`.
    ///
    /// # Errors
    /// [`Error::Io`] if `addr` cannot be resolved or bound (e.g. in use), or the listener's
    /// acceptor thread cannot start.
    /// [`Error::DeviceRemoved`] if `pd`'s device was removed.
    pub fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Listener> {
        Listener::bind_offering(addr, pd, &opts, false)
    }

    /// As [`Listener::bind`]; with `control`, handshakes offer a control channel.
    pub(crate) fn bind_offering(addr: impl ToSocketAddrs, pd: &Pd, opts: &Options, control: bool) -> Result<Listener> {
        pd.context().usable_for_new()?;
        let tcp = TcpListener::bind(addr).map_err(io("binding the TCP listener".into()))?;
        let addr = tcp.local_addr().map_err(io("reading the listener's address".into()))?;
        let (accepting, acceptor) = Accepting::start(tcp, pd, opts, control)?;
        Ok(Listener { addr, accepting, acceptor: Some(acceptor), born: crate::fork::Born::now() })
    }

    /// The address it listens on.
    ///
    /// # Errors
    /// None at present (the address is read when binding); kept fallible for listeners that
    /// may lose theirs.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.addr)
    }

    /// Accepts the next connection.
    ///
    /// # Errors
    /// As [`Listener::accept_with`].
    pub fn accept(&self) -> Result<Connection> {
        self.accept_with(&[])
    }

    /// Accepts the next connection, sending `blob` (e.g. an encoded [`crate::RemoteBuf`]) to the
    /// peer with this side's endpoint. With
    /// [`SetupOptions::secret`](crate::transfer::SetupOptions::secret) set, the peer must prove it
    /// holds the same secret before a QP is created for it or `blob` is sent. Waits for a client
    /// whose exchange reached that point (handshakes run in the background: see [`Listener`]).
    ///
    /// A client whose setup fails (garbage, silence, a wrong secret, a client that goes away:
    /// [`Error::Io`], [`Error::Authentication`], [`Error::Protocol`], [`Error::Timeout`]) is that
    /// client's problem: the call goes on waiting for the next client, and the failure is
    /// counted and kept ([`Listener::failed_handshakes`], [`Listener::take_handshake_failures`]),
    /// so that `loop { let conn = listener.accept()?; ... }` survives any client.
    ///
    /// # Errors
    /// Failures of this side's own steps (a client's messages, secret or going away never end
    /// the call):
    /// - [`Error::InvalidArgument`] if `blob` is longer than
    ///   [`MAX_BLOB`](crate::transfer::MAX_BLOB) (found only when it is sent, after
    ///   the QP was created).
    /// - As [`Connection::pair`] if creating the QP or setting up the connection's watcher
    ///   fails, or if the device is removed. (Connecting the QP uses the client's endpoint: a
    ///   client whose endpoint the device refuses, an unroutable GID, is that client's failure.)
    /// - [`Error::Forked`] in a fork()ed child; [`Error::Protocol`] if a handshake thread ended
    ///   without an answer (a panic).
    pub fn accept_with(&self, blob: &[u8]) -> Result<Connection> {
        // A fork()ed child has no acceptor thread (and a parent thread may hold its locks).
        self.born.check("this listener")?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.accepting.offer(blob.to_vec(), Reply::Blocking(tx));
        // The handshake that takes the offer always answers (its thread catches nothing, but a
        // panic there drops the sender).
        rx.recv().unwrap_or_else(|_| Err(no_answer())).map(Established::into_blocking)
    }

    /// How many client setups are running now: TCP connections taken and not yet handed to an
    /// accept call or failed (at most [`crate::transfer::SetupOptions::max_handshakes`]; further
    /// clients wait in the kernel's backlog). A gauge for monitoring a server under load.
    pub fn handshakes_in_flight(&self) -> usize {
        self.accepting.in_flight()
    }

    /// How many clients' setups failed since the listener was bound (see
    /// [`Listener::accept_with`]).
    pub fn failed_handshakes(&self) -> u64 {
        self.accepting.failed_total()
    }

    /// The most recent failed client setups (at most 64; older ones are only counted), oldest
    /// first, taken out of the listener: who, and the typed error.
    pub fn take_handshake_failures(&self) -> Vec<HandshakeFailure> {
        self.accepting.take_failures()
    }

    /// The PD connections are made in.
    #[cfg(feature = "tokio")]
    pub(crate) fn pd(&self) -> &Pd {
        self.accepting.pd()
    }

    /// The shared accepting state (the async listener offers through it).
    #[cfg(feature = "tokio")]
    pub(crate) fn accepting(&self) -> &Arc<Accepting> {
        &self.accepting
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if !self.born.here() {
            std::mem::forget(self.acceptor.take()); // the parent's thread: not ours to detach
            return;
        }
        self.accepting.stop();
        if let Some(t) = self.acceptor.take() {
            // Within ~100 ms: the acceptor polls with that timeout. The port is free after.
            let _ = t.join();
        }
    }
}

impl Connection {
    /// Connects to a [`Listener`] at `addr`, in `pd`.
    ///
    /// # Errors
    /// As [`Connection::connect_with`].
    pub fn connect(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Connection> {
        Connection::connect_with(addr, pd, opts, &[])
    }

    /// Connects, sending `blob` to the peer with this side's endpoint. With
    /// [`SetupOptions::secret`](crate::transfer::SetupOptions::secret) set, the listener must prove
    /// it holds the same secret before a QP is created or `blob` is sent.
    ///
    /// # Errors
    /// - [`Error::Io`] if reading or writing the TCP connection fails, the whole exchange takes
    ///   longer than
    ///   [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout), or the
    ///   listener closes it.
    /// - [`Error::Authentication`] if the secrets differ or only one side has one.
    /// - [`Error::Protocol`] if the listener sends something other than the exchange expects.
    /// - [`Error::InvalidArgument`] if `blob` is longer than
    ///   [`MAX_BLOB`](crate::transfer::MAX_BLOB).
    /// - As [`Connection::pair`] if creating or connecting the QP fails.
    /// - [`Error::Io`] if `addr` cannot be resolved or the TCP connect fails (each address `addr`
    ///   resolves to is tried in turn, within
    ///   [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout) for the
    ///   whole setup: the last failure is reported; while every address refuses the connection —
    ///   nothing listens there yet — they are tried again until that deadline, so a client may
    ///   start before its server); [`Error::Timeout`] if no address was tried before the deadline;
    ///   [`Error::InvalidArgument`] if it resolves to nothing.
    pub fn connect_with(addr: impl ToSocketAddrs, pd: &Pd, opts: Options, blob: &[u8]) -> Result<Connection> {
        Connection::connect_offering(addr, pd, opts, blob, false).map(Established::into_blocking)
    }

    /// As [`Connection::connect_with`]; with `control`, offers a control channel (set up if the
    /// listener offers one too).
    pub(crate) fn connect_offering(
        addr: impl ToSocketAddrs,
        pd: &Pd,
        opts: Options,
        blob: &[u8],
        control: bool,
    ) -> Result<Established> {
        let until = deadline_after(opts.setup.connect_timeout);
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(io("resolving the peer address".into()))?.collect();
        if addrs.is_empty() {
            return Err(Error::InvalidArgument("the address resolved to nothing".into()));
        }
        // Each address in turn, within the one deadline; the last failure is reported. While
        // every address refuses (nothing listens there yet: the peer is starting), all are
        // tried again after a pause that grows to half a second, until the deadline.
        let mut last = None;
        let mut stream = None;
        let mut pause = Duration::from_millis(10);
        'tries: loop {
            let mut refused = true;
            for target in &addrs {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break 'tries;
                }
                match TcpStream::connect_timeout(target, left) {
                    Ok(s) => {
                        stream = Some(s);
                        break 'tries;
                    }
                    Err(e) => {
                        refused &= e.kind() == std::io::ErrorKind::ConnectionRefused;
                        last = Some((*target, e));
                    }
                }
            }
            let left = until.saturating_duration_since(Instant::now());
            if !refused || left.is_zero() {
                break;
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(500));
        }
        let s = match (stream, last) {
            (Some(s), _) => s,
            (None, Some((target, e))) => return Err(io(format!("connecting to {target} (is the peer listening?)"))(e)),
            (None, None) => {
                return Err(Error::Timeout(opts.setup.connect_timeout, "a TCP connection to the peer"));
            }
        };
        let mut s = Timed::new(s, until, opts.setup.connect_timeout)?;
        let x = auth::client(&mut s, opts.setup.secret.as_ref(), blob, || {
            let prepared = Prepared::new(pd, &opts, control)?;
            let (me, control) = prepared.endpoints();
            Ok((prepared, me, control))
        })?;
        let mut conn = x.prepared.finish(pd, &opts, x.peer, x.peer_control, x.peer_blob)?;
        Message::new(Kind::Ready, Some(x.me), Vec::new()).send(&mut s)?;
        expect(Message::recv(&mut s)?, Kind::Ready)?;
        keep_watched(&mut conn, s)?;
        Ok(conn)
    }
}
