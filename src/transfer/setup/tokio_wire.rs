//! The TCP setup exchange on tokio (feature `tokio`): [`TokioWire`], a `tokio::net::TcpStream`
//! whose reads and writes end at the exchange's deadline (a `tokio::time` timer wakes the task
//! then), and [`TokioDial`], the client's connects and pauses. No thread of its own: creating a
//! queue pair is a short kernel call, made in place; connecting it (RTR/RTS, which on RoCE may
//! wait for the peer's GID to resolve) runs on tokio's blocking pool ([`Socket::run_blocking`]).

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::error::{Error, Result};
use crate::transfer::setup::handshake::Dial;
use crate::transfer::setup::wire::{Deadline, Socket, Wire};

/// A setup stream on tokio's reactor, bounded by the exchange's deadline.
pub(crate) struct TokioWire {
    s: TcpStream,
    deadline: Deadline,
    /// Wakes the task when the deadline passes.
    expiry: Pin<Box<Sleep>>,
    /// Wakes the task at the time it waits for ([`Wire::poll_until`]).
    timer: Option<(Instant, Pin<Box<Sleep>>)>,
}

impl TokioWire {
    /// The setup stream over `s` (with `TCP_NODELAY`).
    ///
    /// # Errors
    /// [`Error::Io`] if `TCP_NODELAY` cannot be set.
    pub(crate) fn new(s: TcpStream, deadline: Deadline) -> Result<TokioWire> {
        s.set_nodelay(true).map_err(|source| Error::Io { what: "setting TCP_NODELAY".into(), source })?;
        let expiry = Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(deadline.at())));
        Ok(TokioWire { s, deadline, expiry, timer: None })
    }

    /// One read or write: `ready` polls the socket's readiness, `step` tries the call.
    fn io<T>(
        &mut self,
        cx: &mut Context<'_>,
        ready: impl Fn(&TcpStream, &mut Context<'_>) -> Poll<std::io::Result<()>>,
        mut step: impl FnMut(&TcpStream) -> std::io::Result<T>,
    ) -> Poll<std::io::Result<T>> {
        loop {
            if let Err(e) = self.deadline.left() {
                return Poll::Ready(Err(e));
            }
            match ready(&self.s, cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => match step(&self.s) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    r => return Poll::Ready(r),
                },
                // The deadline's timer wakes the task too; once it fired, the exchange is over
                // (whatever the clock says: tokio's may be paused or ahead of `Instant`).
                Poll::Pending if self.expiry.as_mut().poll(cx).is_ready() => {
                    return Poll::Ready(Err(self.deadline.expired()))
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Wire for TokioWire {
    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<std::io::Result<usize>> {
        self.io(cx, |s, cx| s.poll_read_ready(cx), |s| s.try_read(buf))
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.io(cx, |s, cx| s.poll_write_ready(cx), |s| s.try_write(buf))
    }

    fn poll_until(&mut self, cx: &mut Context<'_>, t: Instant) -> Poll<()> {
        if Instant::now() >= t {
            return Poll::Ready(());
        }
        let timer = match &mut self.timer {
            Some((at, sleep)) if *at == t => sleep,
            slot => &mut slot.insert((t, Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(t))))).1,
        };
        timer.as_mut().poll(cx)
    }
}

impl Socket for TokioWire {
    fn fd(&self) -> RawFd {
        self.s.as_raw_fd()
    }

    fn into_std(self) -> Result<std::net::TcpStream> {
        self.s.into_std().map_err(|source| Error::Io { what: "taking the setup stream off the reactor".into(), source })
    }

    /// On tokio's blocking pool, not in place: a worker thread (the only one, on a
    /// `current_thread` runtime) must not wait for a device. Not `block_in_place`: it panics on
    /// a `current_thread` runtime, and stalls whatever else the calling task polls (a `select!`).
    /// The step owns its queue pairs: dropping this future detaches the task, which finishes
    /// the step and drops them on the pool (a runtime shutting down drops a step not started
    /// yet, and them with it).
    fn run_blocking<T: Send + 'static>(
        &mut self,
        step: impl FnOnce() -> T + Send + 'static,
    ) -> impl Future<Output = Result<T>> + Send {
        let task = tokio::task::spawn_blocking(step);
        async move {
            task.await.map_err(|e| Error::Io {
                what: "a connection setup step on tokio's blocking pool".into(),
                source: std::io::Error::other(e),
            })
        }
    }
}

/// The tokio client driver: `TcpStream::connect` within the time left, `tokio::time::sleep`
/// between tries.
pub(crate) struct TokioDial;

impl Dial for TokioDial {
    type Stream = TcpStream;
    type Wire = TokioWire;

    async fn dial(&mut self, to: SocketAddr, left: Duration) -> std::io::Result<TcpStream> {
        match tokio::time::timeout(left, TcpStream::connect(to)).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the TCP connect timed out")),
        }
    }

    fn pause(&mut self, d: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(d)
    }

    fn wire(&mut self, s: TcpStream, deadline: Deadline) -> Result<TokioWire> {
        TokioWire::new(s, deadline)
    }
}

#[cfg(test)]
#[path = "tokio_wire_tests.rs"]
mod tests;
