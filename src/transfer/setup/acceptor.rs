//! What a TCP listener's handshakes share with its accept calls, whichever driver runs them
//! (the blocking [`crate::transfer::Listener`]'s own accept calls, or tokio tasks for
//! [`crate::transfer::AsyncListener`]): admission (at most [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes)
//! handshakes at once; further clients wait in the kernel's backlog), *offers*, the failure
//! bookkeeping, and the handshake itself ([`Accepting::handshake`]).
//!
//! A handshake has one deadline for the whole exchange ([`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout)): a client
//! that trickles its bytes is dropped when it expires, whatever the others do. A client whose
//! hello arrived waits for an *offer* — an [`crate::transfer::Listener::accept_with`] call (or
//! its async twin) with the blob to send — and only then gets a QP; the accept call gets that
//! handshake's connection, or a failure of this side's own (creating the QP, say). A client's
//! failure (garbage, silence, a refused secret, a client that goes away), before or after it
//! took an offer, is counted and kept ([`HandshakeFailure`]) and never ends an accept call: a
//! taken offer goes back to the front of the queue.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
#[cfg(feature = "tokio")]
use std::task::Context;
use std::task::{Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::transfer::setup::control::Established;
use crate::transfer::setup::handshake::{serve, Blob, Failed};
use crate::transfer::setup::wire::{Deadline, Socket};
use crate::transfer::Options;
use crate::verbs::Pd;

/// Where a handshake's outcome goes: the accept call that offered the blob.
pub(crate) enum Reply {
    /// A blocking accept call: the answer's channel, and whether the call still waits.
    Blocking(std::sync::mpsc::SyncSender<Result<Established>>, Arc<AtomicBool>),
    #[cfg(feature = "tokio")]
    Async(tokio::sync::oneshot::Sender<Result<Established>>),
}

impl Reply {
    /// A blocking accept call's reply, its answer's receiver, and the guard that says the call
    /// waits (until it drops: the call returned or unwound).
    pub(crate) fn blocking() -> (Reply, std::sync::mpsc::Receiver<Result<Established>>, Waiting) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let waiting = Arc::new(AtomicBool::new(true));
        (Reply::Blocking(tx, waiting.clone()), rx, Waiting(waiting))
    }

    /// Whether nobody waits for the answer any more (a cancelled async accept, a blocking one
    /// that unwound).
    fn is_closed(&self) -> bool {
        match self {
            Reply::Blocking(_, waiting) => !waiting.load(Ordering::Acquire),
            #[cfg(feature = "tokio")]
            Reply::Async(tx) => tx.is_closed(),
        }
    }

    fn send(self, r: Result<Established>) {
        // A receiver that is gone (a cancelled async accept) drops the connection: the client
        // sees its setup stream close.
        match self {
            Reply::Blocking(tx, _) => drop(tx.send(r)),
            #[cfg(feature = "tokio")]
            Reply::Async(tx) => drop(tx.send(r)),
        }
    }
}

/// A blocking accept call waiting for its answer; its drop says it no longer does.
pub(crate) struct Waiting(Arc<AtomicBool>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// What an accept call reports if its handshake ended without answering (it panicked).
pub(crate) fn no_answer() -> Error {
    Error::Protocol("the handshake ended without an answer".into())
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

/// Accept calls waiting, the handshakes, and the clients whose handshakes failed.
#[derive(Default)]
struct Queues {
    offers: VecDeque<Offer>,
    /// The most recent failed handshakes, oldest first; at most [`MAX_FAILED`].
    failed: VecDeque<HandshakeFailure>,
    /// Every failed handshake since the listener was bound.
    failed_total: u64,
    /// Handshakes admitted and not yet ended (their [`Ticket`]s).
    in_flight: usize,
    /// Handshakes waiting for an offer: woken by one, and by [`Accepting::stop`].
    waiting: Vec<Waker>,
    /// A driver waiting for a handshake slot to free up.
    slot_waiting: Vec<Waker>,
}

/// Connections the kernel queues for a listener while its handshakes are at the bound or nobody
/// drives them (clamped by `net.core.somaxconn`).
const BACKLOG: i32 = 4096;

/// A non-blocking TCP listener on `addr` with a long backlog, and its address.
///
/// # Errors
/// [`Error::Io`] if `addr` cannot be resolved or bound (e.g. in use), or the socket cannot be
/// made non-blocking.
pub(crate) fn bind(addr: impl std::net::ToSocketAddrs) -> Result<(std::net::TcpListener, SocketAddr)> {
    let io = |what: &str| {
        let what = what.to_string();
        move |source| Error::Io { what, source }
    };
    let tcp = std::net::TcpListener::bind(addr).map_err(io("binding the TCP listener"))?;
    let addr = tcp.local_addr().map_err(io("reading the listener's address"))?;
    tcp.set_nonblocking(true).map_err(io("making the TCP listener non-blocking"))?;
    // Longer than std's 128; best effort (listen(2) again only changes the backlog).
    // SAFETY: listen(2) on a socket this function owns, already listening.
    unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&tcp), BACKLOG) };
    Ok((tcp, addr))
}

/// Failed handshakes kept for [`Accepting::take_failures`]; older ones are only counted.
const MAX_FAILED: usize = 64;

/// A handshake stops waiting for an accept call this long before its deadline (at most), so
/// that the accept call that takes it has time left to finish the exchange.
const MARGIN: Duration = Duration::from_secs(1);

/// What a listener's handshakes share with its accept calls.
pub(crate) struct Accepting {
    pd: Pd,
    opts: Options,
    /// Offer a control channel (async listeners).
    control: bool,
    queues: Mutex<Queues>,
    next_offer: AtomicU64,
    stop: AtomicBool,
}

/// A handshake's slot among [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes), given back when it drops.
pub(crate) struct Ticket(Arc<Accepting>);

impl Drop for Ticket {
    fn drop(&mut self) {
        let wake = {
            let mut q = self.0.queues.lock();
            q.in_flight -= 1;
            std::mem::take(&mut q.slot_waiting)
        };
        wake.into_iter().for_each(Waker::wake);
    }
}

impl Accepting {
    /// The shared state of a listener making connections in `pd` with `opts`; with `control`,
    /// handshakes offer a control channel.
    pub(crate) fn new(pd: &Pd, opts: &Options, control: bool) -> Arc<Accepting> {
        Arc::new(Accepting {
            pd: pd.clone(),
            opts: opts.clone(),
            control,
            queues: Mutex::new(Queues::default()),
            next_offer: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        })
    }

    /// Stops accepting; handshakes waiting for an offer give up (an async listener's handshake
    /// tasks outlive it; a blocking listener's handshakes are dropped with it).
    #[cfg(feature = "tokio")]
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let wake = std::mem::take(&mut self.queues.lock().waiting);
        wake.into_iter().for_each(Waker::wake);
    }

    /// The PD connections are made in.
    #[cfg(feature = "tokio")]
    pub(crate) fn pd(&self) -> &Pd {
        &self.pd
    }

    /// A new handshake's deadline: [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout) from now.
    pub(crate) fn deadline(&self) -> Deadline {
        Deadline::after(self.opts.setup.connect_timeout)
    }

    /// Handshakes in flight (TCP accepted, not yet handed to an accept call or failed).
    pub(crate) fn in_flight(&self) -> usize {
        self.queues.lock().in_flight
    }

    /// At most this many handshakes in flight ([`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes)).
    pub(crate) fn max_handshakes(&self) -> usize {
        self.opts.setup.max_handshakes.max(1)
    }

    /// A slot for one more handshake, unless [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes) are in flight.
    pub(crate) fn admit(self: &Arc<Self>) -> Option<Ticket> {
        let mut q = self.queues.lock();
        if q.in_flight >= self.max_handshakes() {
            return None;
        }
        q.in_flight += 1;
        Some(Ticket(self.clone()))
    }

    /// Ready while fewer than [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes) handshakes are in flight; else woken
    /// when one ends.
    #[cfg(feature = "tokio")]
    pub(crate) fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut q = self.queues.lock();
        if q.in_flight < self.max_handshakes() {
            return Poll::Ready(());
        }
        q.slot_waiting.push(cx.waker().clone());
        Poll::Pending
    }

    /// Queues an accept call's blob; the handshake that takes it answers on `reply` with a
    /// connection (or a failure of this side). Returns the offer's id (for
    /// [`Accepting::withdraw`]).
    pub(crate) fn offer(&self, blob: Vec<u8>, reply: Reply) -> u64 {
        let id = self.next_offer.fetch_add(1, Ordering::Relaxed);
        self.put(Offer { id, blob, reply }, false);
        id
    }

    /// Queues an offer (at the front: one a failed client had taken) and wakes the handshakes
    /// waiting for one.
    fn put(&self, offer: Offer, front: bool) {
        let wake = {
            let mut q = self.queues.lock();
            if front {
                q.offers.push_front(offer);
            } else {
                q.offers.push_back(offer);
            }
            std::mem::take(&mut q.waiting)
        };
        wake.into_iter().for_each(Waker::wake);
    }

    /// Takes back an offer no handshake took yet (a cancelled async accept).
    #[cfg(feature = "tokio")]
    pub(crate) fn withdraw(&self, id: u64) {
        self.queues.lock().offers.retain(|o| o.id != id);
    }

    /// Failed handshakes since the listener was bound.
    pub(crate) fn failed_total(&self) -> u64 {
        self.queues.lock().failed_total
    }

    /// The most recent failed handshakes (at most [`MAX_FAILED`]), oldest first, taken out.
    pub(crate) fn take_failures(&self) -> Vec<HandshakeFailure> {
        self.queues.lock().failed.drain(..).collect()
    }

    /// Records a client's failed handshake (logged, counted, kept among the recent ones).
    fn record(&self, peer: SocketAddr, error: Error) {
        tracing::debug!(%peer, "a client's connection setup failed: {error}");
        let mut q = self.queues.lock();
        q.failed_total += 1;
        if q.failed.len() == MAX_FAILED {
            q.failed.pop_front();
        }
        q.failed.push_back(HandshakeFailure { peer, error });
    }

    /// One client's handshake on its accepted stream `s`, to the end: the connection goes to
    /// the accept call whose offer it took, a client's failure to the records. Holds `_slot`
    /// until it ends.
    pub(crate) async fn handshake<W: Socket>(
        self: Arc<Self>,
        s: W,
        peer: SocketAddr,
        deadline: Deadline,
        _slot: Ticket,
    ) {
        let mut taking = Taking { accepting: &self, deadline, taken: None };
        let r = serve(s, peer, &self.pd, &self.opts, self.control, &mut taking).await;
        match (taking.taken, r) {
            // The client failed after taking an accept call's blob: the call waits for the next
            // client (its offer goes back to the front of the queue, unless it was cancelled).
            (Some(offer), Err(f)) if clients_failure(&f) => {
                self.record(peer, f.error);
                if !offer.reply.is_closed() {
                    self.put(offer, true);
                }
            }
            (Some(offer), r) => offer.reply.send(r.map_err(|f| f.error)),
            // Failed before (garbage, silence, a refused secret, no accept call in time).
            (None, Err(f)) if clients_failure(&f) => self.record(peer, f.error),
            (None, Err(Failed { error: Error::Closed, .. })) => {
                tracing::debug!(%peer, "a handshake ended: the listener closed")
            }
            (None, Err(f)) => tracing::warn!(%peer, "a handshake ended before an accept call took it: {}", f.error),
            (None, Ok(_)) => tracing::error!(%peer, "a handshake completed without an accept call's blob; dropped"),
        }
    }

    /// Waits for an accept call's offer, until a margin before `deadline` (the accept call
    /// needs time to finish the exchange). A client (on `s`) that hangs up meanwhile fails at
    /// once (it is looked at each time this is polled, and the driver wakes it then); an offer
    /// is used only if someone still waits for the answer.
    async fn take_offer(&self, s: &mut impl Socket, deadline: Deadline) -> Result<Offer> {
        let margin = MARGIN.min(self.opts.setup.connect_timeout / 4);
        let until = deadline.at().checked_sub(margin).unwrap_or(deadline.at());
        let fd = s.fd();
        poll_fn(|cx| {
            if !peer_open(fd) {
                return Poll::Ready(Err(Error::Protocol(
                    "the client closed its connection while waiting to be accepted".into(),
                )));
            }
            let mut q = self.queues.lock();
            if self.stop.load(Ordering::Acquire) {
                return Poll::Ready(Err(Error::Closed));
            }
            // Offers of cancelled accepts go; the rest wait their turn.
            q.offers.retain(|o| !o.reply.is_closed());
            if let Some(o) = q.offers.pop_front() {
                return Poll::Ready(Ok(o));
            }
            s.watch_hangup();
            if !q.waiting.iter().any(|w| w.will_wake(cx.waker())) {
                q.waiting.push(cx.waker().clone());
            }
            drop(q);
            match s.poll_until(cx, until) {
                Poll::Ready(()) => Poll::Ready(Err(Error::Timeout(
                    self.opts.setup.connect_timeout,
                    "an accept call to take the connection",
                ))),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }
}

/// A handshake's [`Blob`]: the offer it takes, kept to answer (or put back) once it ends.
struct Taking<'a> {
    accepting: &'a Accepting,
    deadline: Deadline,
    taken: Option<Offer>,
}

impl<W: Socket> Blob<W> for Taking<'_> {
    async fn take(&mut self, s: &mut W) -> Result<Vec<u8>> {
        let offer = self.accepting.take_offer(s, self.deadline).await?;
        let blob = offer.blob.clone();
        self.taken = Some(offer);
        Ok(blob)
    }
}

/// Whether the client on `fd` still has its end open (no hang-up, no EOF pending).
fn peer_open(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd on a socket this handshake owns; no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 0 || p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0
}
