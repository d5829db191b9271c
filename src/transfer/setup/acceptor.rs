//! Background handshakes for TCP listeners: no client can hold up another.
//!
//! One acceptor thread per listener takes TCP connections as they come and gives each its own
//! handshake thread (at most
//! [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes) at once; a
//! connection beyond that is closed at once). A handshake has one deadline for the whole exchange
//! ([`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout)): a client
//! that trickles its bytes is dropped when it expires, whatever the others do. A client whose hello
//! arrived waits for an *offer* — an [`crate::transfer::Listener::accept_with`] call (or its async
//! twin) with the blob to send — and only then gets a QP; the accept call gets that handshake's
//! connection, or a failure of this side's own (creating the QP, say). A client's failure (garbage,
//! silence, a refused secret, a client that goes away), before or after it took an offer, is
//! counted and kept ([`HandshakeFailure`]) and never ends an accept call: a taken offer goes back
//! to the front of the queue.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::transfer::setup::control::Established;
use crate::transfer::setup::handshake::{serve, Failed};
use crate::transfer::Options;
use crate::verbs::Pd;

/// Where a handshake's outcome goes: the accept call that offered the blob.
pub(crate) enum Reply {
    Blocking(std::sync::mpsc::SyncSender<Result<Established>>),
    #[cfg(feature = "tokio")]
    Async(tokio::sync::oneshot::Sender<Result<Established>>),
}

impl Reply {
    /// Whether nobody waits for the answer any more (a cancelled async accept).
    fn is_closed(&self) -> bool {
        match self {
            Reply::Blocking(_) => false,
            #[cfg(feature = "tokio")]
            Reply::Async(tx) => tx.is_closed(),
        }
    }

    fn send(self, r: Result<Established>) {
        // A receiver that is gone (a cancelled async accept) drops the connection: the client
        // sees its setup stream close.
        match self {
            Reply::Blocking(tx) => drop(tx.send(r)),
            #[cfg(feature = "tokio")]
            Reply::Async(tx) => drop(tx.send(r)),
        }
    }
}

/// What an accept call reports if its handshake's thread ended without answering (it panicked).
pub(crate) fn no_answer() -> Error {
    Error::Protocol("the handshake thread ended without an answer".into())
}

/// A client whose connection setup failed (garbage, silence, a wrong secret, a client that went
/// away): that client's problem, never the listener's. Accept calls go on waiting for the next
/// client; the listener keeps the most recent failures for whoever wants to look
/// ([`crate::transfer::Listener::take_handshake_failures`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct HandshakeFailure {
    /// The client's address.
    pub peer: SocketAddr,
    /// What went wrong: [`Error::Io`] (its TCP connection failed, timed out, or closed),
    /// [`Error::Authentication`], [`Error::Protocol`], or [`Error::Timeout`] (no accept call took
    /// the client within
    /// [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout): this side
    /// was not accepting).
    pub error: Error,
}

/// Whether a failed handshake is the client's failure: it came from the client's side of the
/// exchange (not a step of this side's own, such as creating the queue pair, which the accept
/// call reports) and is of a client's kind — its messages, its secret, its going away, or its
/// endpoint, which the device refused when this side's queue pair was connected to it.
fn clients_failure(f: &Failed) -> bool {
    f.by_client
        && matches!(
            f.error,
            Error::Io { .. }
                | Error::Authentication(_)
                | Error::Protocol(_)
                | Error::Timeout(..)
                | Error::Verbs { verb: "ibv_modify_qp", .. }
        )
}

/// An accept call waiting for a handshake to serve.
struct Offer {
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    id: u64,
    blob: Vec<u8>,
    reply: Reply,
}

/// Accept calls waiting, and the clients whose handshakes failed.
#[derive(Default)]
struct Queues {
    offers: VecDeque<Offer>,
    /// The most recent failed handshakes, oldest first; at most [`MAX_FAILED`].
    failed: VecDeque<HandshakeFailure>,
    /// Every failed handshake since the listener was bound.
    failed_total: u64,
}

/// Failed handshakes kept for [`Accepting::take_failures`]; older ones are only counted.
const MAX_FAILED: usize = 64;

/// A handshake stops waiting for an accept call this long before its deadline (at most), so
/// that the accept call that takes it has time left to finish the exchange.
const MARGIN: Duration = Duration::from_secs(1);

/// What the acceptor and handshake threads share with the listener.
pub(crate) struct Accepting {
    pd: Pd,
    opts: Options,
    /// Offer a control channel (async listeners).
    control: bool,
    offers: Mutex<Queues>,
    offered: Condvar,
    next_offer: AtomicU64,
    in_flight: AtomicUsize,
    stop: AtomicBool,
}

impl Accepting {
    /// Starts the acceptor thread on `tcp`; it runs until [`Accepting::stop`].
    ///
    /// # Errors
    /// [`Error::Io`] if the listener cannot be made non-blocking or the thread cannot start.
    pub(crate) fn start(
        tcp: TcpListener,
        pd: &Pd,
        opts: &Options,
        control: bool,
    ) -> Result<(Arc<Accepting>, std::thread::JoinHandle<()>)> {
        tcp.set_nonblocking(true)
            .map_err(|source| Error::Io { what: "making the TCP listener non-blocking".into(), source })?;
        let a = Arc::new(Accepting {
            pd: pd.clone(),
            opts: opts.clone(),
            control,
            offers: Mutex::new(Queues::default()),
            offered: Condvar::new(),
            next_offer: AtomicU64::new(1),
            in_flight: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let run = a.clone();
        let t = std::thread::Builder::new()
            .name("mralloc-accept".into())
            .spawn(move || run.accept_loop(tcp))
            .map_err(|source| Error::Io { what: "starting the listener's acceptor thread".into(), source })?;
        Ok((a, t))
    }

    /// Stops accepting; handshakes waiting for an offer give up.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _g = self.offers.lock();
        self.offered.notify_all();
    }

    /// The PD connections are made in.
    #[cfg(feature = "tokio")]
    pub(crate) fn pd(&self) -> &Pd {
        &self.pd
    }

    /// Handshakes in flight (TCP accepted, not yet handed to an accept call or failed).
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Queues an accept call's blob; the handshake that takes it answers on `reply` with a
    /// connection (or a failure of this side). Returns the offer's id (for
    /// [`Accepting::withdraw`]).
    pub(crate) fn offer(&self, blob: Vec<u8>, reply: Reply) -> u64 {
        let id = self.next_offer.fetch_add(1, Ordering::Relaxed);
        let mut q = self.offers.lock();
        q.offers.push_back(Offer { id, blob, reply });
        self.offered.notify_one();
        id
    }

    /// Takes back an offer no handshake took yet (a cancelled async accept).
    #[cfg(feature = "tokio")]
    pub(crate) fn withdraw(&self, id: u64) {
        self.offers.lock().offers.retain(|o| o.id != id);
    }

    /// Failed handshakes since the listener was bound.
    pub(crate) fn failed_total(&self) -> u64 {
        self.offers.lock().failed_total
    }

    /// The most recent failed handshakes (at most [`MAX_FAILED`]), oldest first, taken out.
    pub(crate) fn take_failures(&self) -> Vec<HandshakeFailure> {
        self.offers.lock().failed.drain(..).collect()
    }

    /// Records a client's failed handshake (logged, counted, kept among the recent ones).
    fn record(&self, peer: SocketAddr, error: Error) {
        tracing::debug!(%peer, "a client's connection setup failed: {error}");
        let mut q = self.offers.lock();
        q.failed_total += 1;
        if q.failed.len() == MAX_FAILED {
            q.failed.pop_front();
        }
        q.failed.push_back(HandshakeFailure { peer, error });
    }

    fn accept_loop(self: Arc<Self>, tcp: TcpListener) {
        let fd = tcp.as_raw_fd();
        let max = self.opts.setup.max_handshakes.max(1);
        while !self.stop.load(Ordering::Acquire) {
            if self.in_flight.load(Ordering::Acquire) >= max {
                // At the bound: further clients wait in the kernel's backlog (then retry their
                // SYNs) until a handshake ends.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd; the timeout bounds how long a stop goes unseen.
            unsafe { libc::poll(&mut p, 1, 100) };
            while !self.stop.load(Ordering::Acquire) && self.in_flight.load(Ordering::Acquire) < max {
                match tcp.accept() {
                    Ok((s, peer)) => self.clone().spawn_handshake(s, peer),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        // EMFILE and friends: say so, let some handshakes finish, go on.
                        tracing::warn!("accepting a TCP connection failed: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                        break;
                    }
                }
            }
        }
    }

    fn spawn_handshake(self: Arc<Self>, s: TcpStream, peer: SocketAddr) {
        /// Gives the handshake's slot back however its thread ends.
        struct Slot(Arc<Accepting>);
        impl Drop for Slot {
            fn drop(&mut self) {
                self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self.clone());
        let spawned =
            std::thread::Builder::new().name("mralloc-handshake".into()).stack_size(256 << 10).spawn(move || {
                slot.0.handshake(s, peer);
                drop(slot);
            });
        if let Err(e) = spawned {
            // The closure, and with it the slot and the stream, were dropped.
            tracing::warn!(%peer, "no thread for a handshake ({e}); connection closed");
        }
    }

    fn handshake(&self, s: TcpStream, peer: SocketAddr) {
        let deadline = deadline_after(self.opts.setup.connect_timeout);
        let fd = s.as_raw_fd();
        let mut taken: Option<Offer> = None;
        let r = serve(s, peer, deadline, &self.pd, &self.opts, self.control, || {
            let offer = self.take_offer(deadline, fd)?;
            let blob = offer.blob.clone();
            taken = Some(offer);
            Ok(blob)
        });
        match (taken, r) {
            // The client failed after taking an accept call's blob: the call waits for the next
            // client (its offer goes back to the front of the queue).
            (Some(offer), Err(f)) if clients_failure(&f) => {
                self.record(peer, f.error);
                self.requeue(offer);
            }
            (Some(offer), r) => offer.reply.send(r.map_err(|f| f.error)),
            // Failed before (garbage, silence, a refused secret, no accept call in time).
            (None, Err(f)) if clients_failure(&f) => self.record(peer, f.error),
            (None, Err(Failed { error: Error::Closed, .. })) => {
                tracing::debug!(%peer, "a handshake ended: the listener closed")
            }
            (None, Err(f)) => tracing::warn!(%peer, "a handshake ended before an accept call took it: {}", f.error),
            (None, Ok(_)) => unreachable!("a handshake completes only with an accept call's blob"),
        }
    }

    /// Puts an offer a failed client had taken back at the front of the queue (unless its accept
    /// call was cancelled meanwhile).
    fn requeue(&self, offer: Offer) {
        if offer.reply.is_closed() {
            return;
        }
        let mut q = self.offers.lock();
        q.offers.push_front(offer);
        self.offered.notify_one();
    }

    /// Waits for an accept call's offer, until a margin before `deadline` (the accept call
    /// needs time to finish the exchange). An offer is used only if the client (`fd`) is still
    /// there and someone still waits for the answer.
    fn take_offer(&self, deadline: Instant, fd: std::os::fd::RawFd) -> Result<Offer> {
        let margin = MARGIN.min(self.opts.setup.connect_timeout / 4);
        let until = deadline.checked_sub(margin).unwrap_or(deadline);
        let mut q = self.offers.lock();
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            // Offers of cancelled accepts go; the rest wait their turn.
            q.offers.retain(|o| !o.reply.is_closed());
            if let Some(o) = q.offers.pop_front() {
                if !peer_open(fd) {
                    q.offers.push_front(o);
                    self.offered.notify_one();
                    return Err(Error::Protocol(
                        "the client closed its connection while waiting to be accepted".into(),
                    ));
                }
                return Ok(o);
            }
            if self.offered.wait_until(&mut q, until).timed_out() && q.offers.is_empty() {
                return Err(Error::Timeout(self.opts.setup.connect_timeout, "an accept call to take the connection"));
            }
        }
    }
}

/// `now + limit`, or far in the future if that overflows (`Duration::MAX` means no limit).
pub(crate) fn deadline_after(limit: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(limit).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// Whether the client on `fd` still has its end open (no hang-up, no EOF pending).
fn peer_open(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd on a socket this handshake owns; no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 0 || p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0
}
