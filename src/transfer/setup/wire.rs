//! The byte stream the TCP setup exchange is written against, so that the exchange (its
//! messages, the shared-secret handshake, both sides' steps) exists once, as `async fn`s, and
//! runs under several drivers:
//!
//! - blocking ([`Plain`] over [`Timed`], polled once by [`block_on`]): `Connection::connect`.
//!   Its reads and writes block, so the future never waits;
//! - a blocking listener's accept calls (`setup/polling.rs`): non-blocking sockets, `poll(2)`;
//! - tokio (`setup/tokio_wire.rs`, feature `tokio`): `AsyncListener`, `AsyncConnection`.
//!
//! Every stream carries the exchange's one deadline ([`Deadline`]): a read or write after it
//! fails with [`std::io::ErrorKind::TimedOut`], whatever the peer does.

use std::future::{poll_fn, Future};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The whole exchange's deadline, and the limit it came from (for the error).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    until: Instant,
    limit: Duration,
}

impl Deadline {
    /// `limit` from now (far in the future if that overflows: `Duration::MAX` means no limit).
    pub(crate) fn after(limit: Duration) -> Deadline {
        let now = Instant::now();
        let until = now.checked_add(limit).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400));
        Deadline { until, limit }
    }

    /// When it passes.
    pub(crate) fn at(&self) -> Instant {
        self.until
    }

    /// Time left; the exchange's timeout error once it passed.
    pub(crate) fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.expired());
        }
        Ok(left)
    }

    /// The exchange's timeout error.
    pub(crate) fn expired(&self) -> std::io::Error {
        let why = format!("the connection setup took longer than {:?} (SetupOptions::connect_timeout)", self.limit);
        std::io::Error::new(std::io::ErrorKind::TimedOut, why)
    }
}

/// A byte stream of the setup exchange. `Pending` only where the driver will wake the task.
pub(crate) trait Wire {
    /// Reads some bytes (0: the peer closed its end), or fails once the deadline passed.
    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<std::io::Result<usize>>;

    /// Writes some bytes, or fails once the deadline passed.
    fn poll_write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>>;

    /// Ready once `t` passed (a listener's handshake waiting for an accept call).
    fn poll_until(&mut self, cx: &mut Context<'_>, t: Instant) -> Poll<()>;
}

/// A [`Wire`] over a TCP socket: what a connection keeps once set up.
pub(crate) trait Socket: Wire {
    /// The socket (to look whether the peer is still there).
    fn fd(&self) -> RawFd;

    /// The socket, to keep with the connection for its life (its watcher reads it).
    fn into_std(self) -> Result<TcpStream>;

    /// Has the task woken when the peer hangs up or the socket fails (a handshake waiting for
    /// an accept call, which looks at the socket each time it is polled). Drivers that poll
    /// their tasks otherwise need nothing.
    fn watch_hangup(&mut self) {}

    /// Runs `step`, a setup step that may block for a while (moving the queue pairs to RTR/RTS:
    /// on RoCE the device resolves the peer's GID then, up to a second or so), where this driver
    /// runs blocking work: in place by default (the blocking drivers' threads are there to
    /// wait); tokio's driver on its blocking pool, so the runtime's worker goes on with other
    /// tasks. `step` owns what it works on and gives it back with its result: a future dropped
    /// meanwhile leaves it with the step, which drops it once done.
    ///
    /// # Errors
    /// [`Error::Io`] if the driver could not run the step to its end (tokio: the blocking task
    /// panicked or its runtime shut down first).
    fn run_blocking<T: Send + 'static>(
        &mut self,
        step: impl FnOnce() -> T + Send + 'static,
    ) -> impl Future<Output = Result<T>> + Send {
        std::future::ready(Ok(step()))
    }
}

/// Fills `buf`; a peer that closes first is [`std::io::ErrorKind::UnexpectedEof`].
pub(crate) async fn read_exact(w: &mut impl Wire, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match poll_fn(|cx| w.poll_read(cx, buf)).await {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf`.
pub(crate) async fn write_all(w: &mut impl Wire, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match poll_fn(|cx| w.poll_write(cx, buf)).await {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Runs a future whose every step completes at once (blocking I/O: [`Plain`]) to its end.
///
/// # Errors
/// The future's; [`Error::Protocol`] if it would have waited (a non-blocking step under this
/// driver: a bug, reported rather than hung or panicked on).
pub(crate) fn block_on<T>(f: impl Future<Output = Result<T>>) -> Result<T> {
    /// Wakes nobody: nothing under this driver waits.
    struct Nobody;
    impl std::task::Wake for Nobody {
        fn wake(self: std::sync::Arc<Self>) {}
    }
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(&Waker::from(std::sync::Arc::new(Nobody)))) {
        Poll::Ready(r) => r,
        Poll::Pending => Err(Error::Protocol("a blocking connection setup step would have waited".into())),
    }
}

/// A blocking stream as a [`Wire`]: every call completes (or fails) before it returns.
pub(crate) struct Plain<S>(pub(crate) S);

impl<S: Read + Write> Wire for Plain<S> {
    fn poll_read(&mut self, _: &mut Context<'_>, buf: &mut [u8]) -> Poll<std::io::Result<usize>> {
        Poll::Ready(self.0.read(buf))
    }

    fn poll_write(&mut self, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Poll::Ready(self.0.write(buf))
    }

    fn poll_until(&mut self, _: &mut Context<'_>, t: Instant) -> Poll<()> {
        std::thread::sleep(t.saturating_duration_since(Instant::now()));
        Poll::Ready(())
    }
}

impl Socket for Plain<Timed> {
    fn fd(&self) -> RawFd {
        self.0.s.as_raw_fd()
    }

    fn into_std(self) -> Result<TcpStream> {
        Ok(self.0.s)
    }
}

/// A blocking setup stream whose reads and writes share one deadline: the whole exchange, not
/// each call, is bounded (a peer trickling one byte a second cannot stretch it).
pub(crate) struct Timed {
    s: TcpStream,
    deadline: Deadline,
}

impl Timed {
    /// # Errors
    /// [`Error::Io`] if `TCP_NODELAY` cannot be set.
    pub(crate) fn new(s: TcpStream, deadline: Deadline) -> Result<Timed> {
        s.set_nodelay(true).map_err(|source| Error::Io { what: "setting TCP_NODELAY".into(), source })?;
        Ok(Timed { s, deadline })
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.s.set_read_timeout(Some(self.deadline.left()?))?;
        self.s.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.s.set_write_timeout(Some(self.deadline.left()?))?;
        self.s.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.s.flush()
    }
}

/// A reader that cannot be written to (to read a message from a byte slice in tests).
#[cfg(test)]
pub(crate) struct ReadOnly<R>(pub(crate) R);

#[cfg(test)]
impl<R: Read> Read for ReadOnly<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

#[cfg(test)]
impl<R> Write for ReadOnly<R> {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
