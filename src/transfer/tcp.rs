//! Connection setup over TCP: endpoints (and an optional application blob) are exchanged with a
//! small versioned message, then both QPs go to RTS and confirm with a `Ready` message before
//! either side may post.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};

use crate::error::{Error, Result};
use crate::transfer::exchange::{Kind, Message};
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

fn expect(m: Message, kind: Kind) -> Result<Message> {
    if m.kind != kind {
        return Err(Error::Protocol(format!("expected a {kind:?} message, got {:?}", m.kind)));
    }
    Ok(m)
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
    pub fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Listener> {
        let tcp = TcpListener::bind(addr).map_err(io("binding the TCP listener".into()))?;
        Ok(Listener { tcp, pd: pd.clone(), opts })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.tcp.local_addr().map_err(io("reading the listener's address".into()))
    }

    /// Accepts the next connection.
    pub fn accept(&self) -> Result<Connection> {
        self.accept_with(&[])
    }

    /// Accepts the next connection, sending `blob` (e.g. an encoded [`crate::RemoteBuf`]) to
    /// the peer with this side's endpoint.
    pub fn accept_with(&self, blob: &[u8]) -> Result<Connection> {
        let (mut s, peer) = self.tcp.accept().map_err(io("accepting a TCP connection".into()))?;
        configure(&s, &self.opts)?;
        let hello = expect(Message::recv(&mut s)?, Kind::Hello)?;
        let prepared = Connection::prepare(&self.pd, &self.opts)?;
        let me = prepared.0.endpoint();
        Message { kind: Kind::Welcome, endpoint: me, blob: blob.to_vec() }.send(&mut s)?;
        let mut conn = Connection::finish(&self.pd, &self.opts, prepared, hello.endpoint, hello.blob, None)?;
        expect(Message::recv(&mut s)?, Kind::Ready)?;
        Message { kind: Kind::Ready, endpoint: me, blob: Vec::new() }.send(&mut s)?;
        tracing::debug!(%peer, "accepted RDMA connection");
        conn._tcp = Some(s);
        Ok(conn)
    }
}

impl Connection {
    /// Connects to a [`Listener`] at `addr`, in `pd`.
    pub fn connect(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Connection> {
        Connection::connect_with(addr, pd, opts, &[])
    }

    /// Connects, sending `blob` to the peer with this side's endpoint.
    pub fn connect_with(addr: impl ToSocketAddrs, pd: &Pd, opts: Options, blob: &[u8]) -> Result<Connection> {
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(io("resolving the peer address".into()))?.collect();
        let target = *addrs.first().ok_or_else(|| Error::InvalidArgument("the address resolved to nothing".into()))?;
        let mut s = TcpStream::connect_timeout(&target, opts.connect_timeout)
            .map_err(io(format!("connecting to {target} (is the peer listening?)")))?;
        configure(&s, &opts)?;
        let prepared = Connection::prepare(pd, &opts)?;
        let me = prepared.0.endpoint();
        Message { kind: Kind::Hello, endpoint: me, blob: blob.to_vec() }.send(&mut s)?;
        let welcome = expect(Message::recv(&mut s)?, Kind::Welcome)?;
        let mut conn = Connection::finish(pd, &opts, prepared, welcome.endpoint, welcome.blob, None)?;
        Message { kind: Kind::Ready, endpoint: me, blob: Vec::new() }.send(&mut s)?;
        expect(Message::recv(&mut s)?, Kind::Ready)?;
        conn._tcp = Some(s);
        Ok(conn)
    }
}
