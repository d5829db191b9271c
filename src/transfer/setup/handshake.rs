//! The TCP setup exchange, both sides, once for every driver (see `wire.rs`): the server side
//! of an accepted stream ([`serve`], run by a listener's handshakes), the client side from the
//! TCP connect on ([`connect`], run by `Connection::connect` and `AsyncConnection::connect`),
//! and the stream kept open and watched for the connection's life ([`keep_watched`]).

use std::future::Future;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transfer::liveness::watch::Source;
use crate::transfer::setup::auth::{self, expect};
use crate::transfer::setup::backoff::Backoff;
use crate::transfer::setup::control::{Established, Prepared};
use crate::transfer::setup::exchange::{Kind, Message};
use crate::transfer::setup::wire::{Deadline, Socket};
use crate::transfer::Options;
use crate::verbs::Pd;

pub(crate) fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

/// The server side of the exchange on an accepted TCP stream `s` (its deadline is the whole
/// exchange's); `blob` gives what to send (it waits for an accept call, and may look at the
/// stream meanwhile); with `control`, a control channel is offered (and set up if the client
/// offers one too).
pub(crate) async fn serve<W: Socket>(
    mut s: W,
    peer: SocketAddr,
    pd: &Pd,
    opts: &Options,
    control: bool,
    blob: &mut impl Blob<W>,
) -> std::result::Result<Established, Failed> {
    let heard = auth::hear(&mut s, opts.setup.secret.as_ref()).await?;
    let blob = blob.take(&mut s).await?;
    let prepared = Prepared::new(pd, opts, control).map_err(Failed::ours)?;
    let ((me, control), grants) = (prepared.endpoints(), prepared.grants());
    let x = auth::welcome(&mut s, heard, (prepared, me, control, grants), blob).await?;
    // The client checked this side's Welcome (and MAC) before saying Ready: only then is the QP
    // connected. The client posts nothing before this side's Ready, sent once it is.
    expect(Message::read_from(&mut s).await?, Kind::Ready)?;
    #[cfg(test)]
    if crate::transfer::setup::control::REFUSE_CLIENT_ENDPOINT.swap(false, std::sync::atomic::Ordering::Relaxed) {
        // What a device says to an endpoint it cannot reach (rxe resolves addresses later).
        return Err(Failed::from(Error::verbs_errno("ibv_modify_qp", libc::EINVAL)));
    }
    // The client's endpoints decide whether the device accepts them (an unroutable GID is
    // refused here): the client's failure, unless this side's device is gone. A step that may
    // block: run where the driver runs those.
    let (prepared, connected) =
        s.run_blocking(x.prepared.connecting(opts, x.peer, x.peer_control)).await.map_err(Failed::ours)?;
    connected.map_err(|e| match e {
        Error::DeviceRemoved { .. } | Error::Forked(_) => Failed::ours(e),
        e => Failed::from(e),
    })?;
    let mut conn = prepared.wrap(pd, opts, x.peer, x.peer_control, x.peer_blob, x.peer_grants).map_err(Failed::ours)?;
    Message::new(Kind::Ready, Some(x.me), Vec::new()).write_to(&mut s).await?;
    tracing::debug!(%peer, authenticated = opts.setup.secret.is_some(), "accepted RDMA connection");
    keep_watched(&mut conn, s).map_err(Failed::ours)?;
    Ok(conn)
}

/// Where [`serve`] gets the blob to send: an accept call's offer, waited for (looking at the
/// client's stream `W` meanwhile).
pub(crate) trait Blob<W> {
    /// The blob, once an accept call offered one.
    async fn take(&mut self, s: &mut W) -> Result<Vec<u8>>;
}

/// A failed [`serve`]: the error, and whether the client caused it (its TCP connection, its
/// messages, its secret) rather than a step of this side's own.
pub(crate) struct Failed {
    pub(crate) error: Error,
    pub(crate) by_client: bool,
}

impl Failed {
    /// A step of this side's own failed (queue pair, connection, watcher): not the client's
    /// failure, whatever its error type.
    fn ours(error: Error) -> Failed {
        Failed { error, by_client: false }
    }
}

impl From<Error> for Failed {
    fn from(error: Error) -> Failed {
        Failed { error, by_client: true }
    }
}

/// How a client driver makes TCP connections and pauses between tries.
pub(crate) trait Dial {
    /// The connected stream.
    type Stream;
    /// The setup stream over it.
    type Wire: Socket;

    /// One TCP connect to `to`, within `left`.
    fn dial(&mut self, to: SocketAddr, left: Duration) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;

    /// Waits `d` before the next round of tries.
    fn pause(&mut self, d: Duration) -> impl Future<Output = ()> + Send;

    /// The setup stream over `s`, bounded by `deadline`.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot be set up (`TCP_NODELAY`, the reactor).
    fn wire(&mut self, s: Self::Stream, deadline: Deadline) -> Result<Self::Wire>;
}

/// The client side: a TCP connection to one of `addrs`, then the exchange, all within
/// [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout); with `control`, offers a control channel (set up if the
/// listener offers one too).
pub(crate) async fn connect<D: Dial>(
    mut d: D,
    addrs: &[SocketAddr],
    pd: &Pd,
    opts: &Options,
    blob: &[u8],
    control: bool,
) -> Result<Established> {
    let deadline = Deadline::after(opts.setup.connect_timeout);
    if addrs.is_empty() {
        return Err(Error::InvalidArgument("the address resolved to nothing".into()));
    }
    let until = deadline.at();
    // Each address in turn, within the one deadline; the last failure is reported. While every
    // address refuses (nothing listens there yet: the peer is starting), all are tried again
    // after a pause that grows to half a second, until the deadline.
    let mut last = None;
    let mut stream = None;
    let mut backoff = Backoff::new();
    // Every address refused every try until the deadline (rather than failing otherwise).
    let mut refused_until_deadline = false;
    'tries: loop {
        let mut refused = true;
        for target in addrs {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                refused_until_deadline = refused && last.is_some();
                break 'tries;
            }
            match d.dial(*target, left).await {
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
            refused_until_deadline = refused;
            break;
        }
        d.pause(backoff.pause(left)).await;
    }
    let s = match (stream, last) {
        (Some(s), _) => s,
        // Refused until the deadline, as the RDMA CM connect reports it: the peer never listened.
        (None, Some(_)) if refused_until_deadline => {
            return Err(Error::Timeout(
                opts.setup.connect_timeout,
                "a TCP listener at the peer (every connect was refused: nothing listens there)",
            ))
        }
        (None, Some((target, e))) => return Err(io(format!("connecting to {target} (is the peer listening?)"))(e)),
        (None, None) => return Err(Error::Timeout(opts.setup.connect_timeout, "a TCP connection to the peer")),
    };
    let mut s = d.wire(s, deadline)?;
    let x = auth::client(&mut s, opts.setup.secret.as_ref(), blob, || {
        let prepared = Prepared::new(pd, opts, control)?;
        let ((me, control), grants) = (prepared.endpoints(), prepared.grants());
        Ok((prepared, me, control, grants))
    })
    .await?;
    // Connecting the QPs may block (see `serve`).
    let (prepared, connected) = s.run_blocking(x.prepared.connecting(opts, x.peer, x.peer_control)).await?;
    connected?;
    let mut conn = prepared.wrap(pd, opts, x.peer, x.peer_control, x.peer_blob, x.peer_grants)?;
    Message::new(Kind::Ready, Some(x.me), Vec::new()).write_to(&mut s).await?;
    expect(Message::read_from(&mut s).await?, Kind::Ready)?;
    keep_watched(&mut conn, s)?;
    Ok(conn)
}

/// The blocking client driver: `connect(2)` with a timeout, `sleep` between tries.
pub(crate) struct BlockingDial;

impl Dial for BlockingDial {
    type Stream = TcpStream;
    type Wire = crate::transfer::setup::wire::Plain<crate::transfer::setup::wire::Timed>;

    fn dial(&mut self, to: SocketAddr, left: Duration) -> impl Future<Output = std::io::Result<TcpStream>> + Send {
        std::future::ready(TcpStream::connect_timeout(&to, left))
    }

    fn pause(&mut self, d: Duration) -> impl Future<Output = ()> + Send {
        std::thread::sleep(d);
        std::future::ready(())
    }

    fn wire(&mut self, s: TcpStream, deadline: Deadline) -> Result<Self::Wire> {
        crate::transfer::setup::wire::Timed::new(s, deadline).map(crate::transfer::setup::wire::Plain)
    }
}

/// The connection keeps its setup stream open for life, and the watcher reads it: its closing
/// is how the peer's end going away shows here.
pub(crate) fn keep_watched(conn: &mut Established, s: impl Socket) -> Result<()> {
    let fd = s.fd();
    let s = s.into_std()?;
    conn.set_peer_addr(s.peer_addr().ok());
    conn.keep(s);
    conn.start_watch(Some(Source::Tcp(fd)))
}
