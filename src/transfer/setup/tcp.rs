//! Connection setup over TCP: endpoints (and an optional application blob) are exchanged with a
//! small versioned message (authenticated when
//! [`SetupOptions::secret`](crate::transfer::SetupOptions::secret) is set: see the `auth` module),
//! then both QPs go to RTS and confirm with a `Ready` message before either side may post.

use std::net::{SocketAddr, ToSocketAddrs};

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::transfer::setup::acceptor::{self, Accepting, HandshakeFailure};
use crate::transfer::setup::control::Established;
use crate::transfer::setup::handshake::{self, io, BlockingDial};
use crate::transfer::setup::polling::Polling;
use crate::transfer::setup::wire::block_on;
use crate::transfer::{Connection, Options};
use crate::verbs::Pd;

/// Accepts RDMA connections whose endpoints arrive over TCP.
///
/// Handshakes run side by side, several at once (up to [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes)), each
/// bounded as a whole by [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout): a slow or silent client delays nobody
/// else. A client whose exchange reached the point where this side must answer waits for an
/// accept call; its queue pair is created only then.
///
/// The listener has no thread of its own: its handshakes make progress inside the calls made
/// on it. An accept call drives them all (non-blocking sockets, `poll(2)`) until its own answer
/// came; several accept calls at once on one listener take turns, and the gauges
/// ([`Listener::handshakes_in_flight`], ...) take a pass that does not wait. While nobody calls,
/// clients wait in the kernel's backlog or where their exchange stopped, and a handshake whose
/// deadline passed meanwhile fails at the next call.
///
/// Connecting a client's queue pair to its endpoint is a kernel call made by the driving call:
/// on RoCE, toward an address the kernel must first resolve (ARP), it can take about a second,
/// and the listener's other handshakes wait that long (their deadlines still hold).
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
    polling: Polling,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("addr", &self.addr)
            .field("handshakes", &self.polling.accepting().in_flight())
            .finish()
    }
}

impl Listener {
    /// Listens on `addr` for connections in `pd`.
    ///
    /// # Errors
    /// [`Error::Io`] if `addr` cannot be resolved or bound (e.g. in use), the socket cannot be
    /// made non-blocking, or the listener's eventfd (which wakes a driving accept call) cannot
    /// be created.
    /// [`Error::DeviceRemoved`] if `pd`'s device was removed; [`Error::Forked`] in a fork()ed
    /// child of the process that opened it.
    pub fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Listener> {
        Listener::bind_offering(addr, pd, &opts, false)
    }

    /// As [`Listener::bind`]; with `control`, handshakes offer a control channel.
    pub(crate) fn bind_offering(addr: impl ToSocketAddrs, pd: &Pd, opts: &Options, control: bool) -> Result<Listener> {
        pd.context().usable_for_new()?;
        let (tcp, addr) = acceptor::bind(addr)?;
        let polling = Polling::new(tcp, Accepting::new(pd, opts, control))?;
        Ok(Listener { addr, polling })
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
    /// whose exchange reached that point, driving the listener's handshakes meanwhile (see
    /// [`Listener`]).
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
    /// - [`Error::Forked`] in a fork()ed child; [`Error::Protocol`] if a handshake ended
    ///   without an answer (a panic).
    pub fn accept_with(&self, blob: &[u8]) -> Result<Connection> {
        self.polling.accept(blob).map(Established::into_blocking)
    }

    /// [`Listener::accept_with`], giving up with [`Error::Timeout`] after `limit`.
    pub(crate) fn accept_within(&self, blob: &[u8], limit: std::time::Duration) -> Result<Connection> {
        self.polling.accept_by(blob, Some(limit)).map(Established::into_blocking)
    }

    /// How many client setups are running now: TCP connections taken and not yet handed to an
    /// accept call or failed (at most [`crate::transfer::SetupOptions::max_handshakes`]; further
    /// clients wait in the kernel's backlog). A gauge for monitoring a server under load.
    ///
    /// Unless an accept call is driving the handshakes, it first takes one pass over them that
    /// does not wait (clients waiting in the backlog are taken, expired handshakes end).
    ///
    /// 0 in a fork()ed child: the handshakes are the parent's (the gauges take no pass there).
    pub fn handshakes_in_flight(&self) -> usize {
        self.polling.progress().map_or(0, Accepting::in_flight)
    }

    /// How many clients' setups failed since the listener was bound (see
    /// [`Listener::accept_with`]).
    ///
    /// As [`Listener::handshakes_in_flight`], it first takes a pass over the handshakes.
    pub fn failed_handshakes(&self) -> u64 {
        self.polling.progress().map_or(0, Accepting::failed_total)
    }

    /// The most recent failed client setups (at most 64; older ones are only counted), oldest
    /// first, taken out of the listener: who, and the typed error.
    ///
    /// As [`Listener::handshakes_in_flight`], it first takes a pass over the handshakes.
    pub fn take_handshake_failures(&self) -> Vec<HandshakeFailure> {
        self.polling.progress().map_or_else(Vec::new, Accepting::take_failures)
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
    ///   start before its server); [`Error::Timeout`] if the deadline passed while every address
    ///   refused the connection, or before any was tried;
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
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(io("resolving the peer address".into()))?.collect();
        block_on(handshake::connect(BlockingDial, &addrs, pd, &opts, blob, control))
    }
}
