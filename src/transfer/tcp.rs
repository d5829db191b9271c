//! Connection setup over TCP: endpoints (and an optional application blob) are exchanged with a
//! small versioned message (authenticated when [`Options::secret`] is set: see the `auth`
//! module), then both QPs go to RTS and confirm with a `Ready` message before either side may
//! post.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;

use crate::error::{Error, Result};
use crate::transfer::auth::{self, expect};
use crate::transfer::control::Prepared;
use crate::transfer::exchange::{Kind, Message};
use crate::transfer::watch::Source;
use crate::transfer::{Connection, Options};
use crate::verbs::Pd;

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

fn configure(s: &TcpStream, opts: &Options) -> Result<()> {
    s.set_read_timeout(Some(opts.connect_timeout)).map_err(io("setting the TCP read timeout".into()))?;
    s.set_write_timeout(Some(opts.connect_timeout)).map_err(io("setting the TCP write timeout".into()))?;
    s.set_nodelay(true).map_err(io("setting TCP_NODELAY".into()))
}

/// Accepts RDMA connections whose endpoints arrive over TCP.
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
    tcp: TcpListener,
    pd: Pd,
    opts: Options,
}

impl Listener {
    /// Listens on `addr` for connections in `pd`.
    ///
    /// # Errors
    /// [`Error::Io`] if `addr` cannot be resolved or bound (e.g. in use).
    pub fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Listener> {
        let tcp = TcpListener::bind(addr).map_err(io("binding the TCP listener".into()))?;
        Ok(Listener { tcp, pd: pd.clone(), opts })
    }

    /// The address it listens on.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot report its address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.tcp.local_addr().map_err(io("reading the listener's address".into()))
    }

    /// Accepts the next connection.
    ///
    /// # Errors
    /// As [`Listener::accept_with`].
    pub fn accept(&self) -> Result<Connection> {
        self.accept_with(&[])
    }

    /// Accepts the next connection, sending `blob` (e.g. an encoded [`crate::RemoteBuf`]) to
    /// the peer with this side's endpoint. With [`Options::secret`] set, the peer must prove it
    /// holds the same secret before a QP is created for it or `blob` is sent.
    ///
    /// # Errors
    /// - [`Error::Io`] if accepting, reading or writing the TCP connection fails, a read or write
    ///   takes longer than [`Options::connect_timeout`], or the peer closes it.
    /// - [`Error::Authentication`] if the secrets differ or only one side has one (the peer is
    ///   told).
    /// - [`Error::Protocol`] if the peer sends something other than the exchange expects.
    /// - [`Error::InvalidArgument`] if `blob` is longer than
    ///   [`MAX_BLOB`](crate::transfer::exchange::MAX_BLOB) (found only when it is sent, after
    ///   the QP was created).
    /// - As [`Connection::pair`] if creating or connecting the QP fails.
    ///
    /// Each error concerns one peer: the listener can accept the next.
    pub fn accept_with(&self, blob: &[u8]) -> Result<Connection> {
        let (s, peer) = self.tcp.accept().map_err(io("accepting a TCP connection".into()))?;
        Listener::serve(s, peer, &self.pd, &self.opts, blob, false)
    }

    /// The server side of the exchange on an accepted (blocking) TCP stream; with `control`, a
    /// control channel is offered (and set up if the client offers one too).
    pub(crate) fn serve(
        mut s: TcpStream,
        peer: SocketAddr,
        pd: &Pd,
        opts: &Options,
        blob: &[u8],
        control: bool,
    ) -> Result<Connection> {
        configure(&s, opts)?;
        let x = auth::server(&mut s, opts.secret.as_ref(), blob, || {
            let prepared = Prepared::new(pd, opts, control)?;
            let (me, control) = prepared.endpoints();
            Ok((prepared, me, control))
        })?;
        // The client checked this side's Welcome (and MAC) before saying Ready: only then is the
        // QP connected. The client posts nothing before this side's Ready, sent once it is.
        expect(Message::recv(&mut s)?, Kind::Ready)?;
        let mut conn = x.prepared.finish(pd, opts, x.peer, x.peer_control, x.peer_blob)?;
        Message::new(Kind::Ready, Some(x.me), Vec::new()).send(&mut s)?;
        tracing::debug!(%peer, authenticated = opts.secret.is_some(), "accepted RDMA connection");
        let fd = s.as_raw_fd();
        conn.keep(s);
        conn.start_watch(Some(Source::Tcp(fd)))?;
        Ok(conn)
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
    /// [`Options::secret`] set, the listener must prove it holds the same secret before a QP is
    /// created or `blob` is sent.
    ///
    /// # Errors
    /// As [`Listener::accept_with`]; [`Error::Io`] if `addr` cannot be resolved or the TCP
    /// connect fails or times out (only the first address `addr` resolves to is tried);
    /// [`Error::InvalidArgument`] if it resolves to nothing.
    pub fn connect_with(addr: impl ToSocketAddrs, pd: &Pd, opts: Options, blob: &[u8]) -> Result<Connection> {
        Connection::connect_offering(addr, pd, opts, blob, false)
    }

    /// As [`Connection::connect_with`]; with `control`, offers a control channel (set up if the
    /// listener offers one too).
    pub(crate) fn connect_offering(
        addr: impl ToSocketAddrs,
        pd: &Pd,
        opts: Options,
        blob: &[u8],
        control: bool,
    ) -> Result<Connection> {
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(io("resolving the peer address".into()))?.collect();
        let target = *addrs.first().ok_or_else(|| Error::InvalidArgument("the address resolved to nothing".into()))?;
        let mut s = TcpStream::connect_timeout(&target, opts.connect_timeout)
            .map_err(io(format!("connecting to {target} (is the peer listening?)")))?;
        configure(&s, &opts)?;
        let x = auth::client(&mut s, opts.secret.as_ref(), blob, || {
            let prepared = Prepared::new(pd, &opts, control)?;
            let (me, control) = prepared.endpoints();
            Ok((prepared, me, control))
        })?;
        let mut conn = x.prepared.finish(pd, &opts, x.peer, x.peer_control, x.peer_blob)?;
        Message::new(Kind::Ready, Some(x.me), Vec::new()).send(&mut s)?;
        expect(Message::recv(&mut s)?, Kind::Ready)?;
        let fd = s.as_raw_fd();
        conn.keep(s);
        conn.start_watch(Some(Source::Tcp(fd)))?;
        Ok(conn)
    }
}
