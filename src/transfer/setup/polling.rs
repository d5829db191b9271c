//! The blocking [`crate::transfer::Listener`]'s handshakes, without threads of their own: they
//! make progress inside the calls made on the listener — deferred work done by ordinary calls,
//! in crossbeam-epoch's spirit.
//!
//! Every handshake is the shared exchange (`Accepting::handshake`) as a future over a
//! non-blocking socket ([`Polled`]). One caller at a time *drives*: it `poll(2)`s the listening
//! socket (while fewer than [`crate::transfer::SetupOptions::max_handshakes`] handshakes are in
//! flight), every handshake's socket and a bell (rung by new offers), until each handshake's
//! own deadline at most, and polls the futures that can go on. An accept call drives until its
//! own answer came; the others wait for theirs, or for the turn to drive. The gauges
//! (`handshakes_in_flight`, ...) take one pass that does not wait, if nobody drives.
//!
//! No handshake waits for another: each waits on its own socket and its own deadline; one whose
//! deadline passed fails at the next pass (a silent or trickling client is closed then).

use std::future::Future;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI16, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::os::Bell;
use crate::transfer::setup::acceptor::{no_answer, Accepting, Reply, Ticket};
use crate::transfer::setup::control::Established;
use crate::transfer::setup::wire::{Deadline, Socket, Wire};

/// How long accepting pauses after `accept(2)` failed (EMFILE and friends).
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// What a handshake's stream and waker tell the driver: the events its socket waits for, the
/// time it waits until (an offer's margin), and whether it was woken (an offer came).
struct Slot {
    interest: AtomicI16,
    timer: Mutex<Option<Instant>>,
    woken: AtomicBool,
    bell: Arc<Bell>,
}

impl Wake for Slot {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.bell.ring();
    }
}

/// A handshake's non-blocking socket: `Pending` on `EWOULDBLOCK`, with the event it waits for
/// left in its [`Slot`].
pub(crate) struct Polled {
    s: TcpStream,
    deadline: Deadline,
    slot: Arc<Slot>,
}

impl Polled {
    fn io<T>(&self, r: std::io::Result<T>, event: libc::c_short) -> Poll<std::io::Result<T>> {
        match r {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                self.slot.interest.fetch_or(event, Ordering::Relaxed);
                Poll::Pending
            }
            r => Poll::Ready(r),
        }
    }
}

impl Wire for Polled {
    fn poll_read(&mut self, _: &mut Context<'_>, buf: &mut [u8]) -> Poll<std::io::Result<usize>> {
        if let Err(e) = self.deadline.left() {
            return Poll::Ready(Err(e));
        }
        let r = std::io::Read::read(&mut self.s, buf);
        self.io(r, libc::POLLIN)
    }

    fn poll_write(&mut self, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if let Err(e) = self.deadline.left() {
            return Poll::Ready(Err(e));
        }
        let r = std::io::Write::write(&mut self.s, buf);
        self.io(r, libc::POLLOUT)
    }

    fn poll_until(&mut self, _: &mut Context<'_>, t: Instant) -> Poll<()> {
        if Instant::now() >= t {
            return Poll::Ready(());
        }
        let mut timer = self.slot.timer.lock();
        *timer = Some(timer.map_or(t, |u| u.min(t)));
        Poll::Pending
    }
}

impl Socket for Polled {
    fn fd(&self) -> RawFd {
        self.s.as_raw_fd()
    }

    fn watch_hangup(&mut self) {
        self.slot.interest.fetch_or(libc::POLLRDHUP, Ordering::Relaxed);
    }

    fn into_std(self) -> Result<TcpStream> {
        Ok(self.s)
    }
}

/// A handshake in flight.
struct InFlight {
    fd: RawFd,
    deadline: Instant,
    slot: Arc<Slot>,
    waker: Waker,
    run: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl InFlight {
    /// Whether it can go on now: its socket has events, it was woken, or a time it waits for
    /// passed.
    fn due(&self, revents: libc::c_short, now: Instant) -> bool {
        revents != 0
            || self.slot.woken.swap(false, Ordering::AcqRel)
            || now >= self.deadline
            || self.slot.timer.lock().is_some_and(|t| now >= t)
    }

    /// When it must be polled at the latest.
    fn wake_at(&self) -> Instant {
        self.slot.timer.lock().map_or(self.deadline, |t| t.min(self.deadline))
    }

    /// Polls it once; whether it ended (a panic ends it too: its offer, if it took one, is
    /// dropped and the accept call reports [`no_answer`]).
    fn poll(&mut self) -> bool {
        self.slot.interest.store(0, Ordering::Relaxed);
        *self.slot.timer.lock() = None;
        let mut cx = Context::from_waker(&self.waker);
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.run.as_mut().poll(&mut cx))) {
            Ok(Poll::Pending) => false,
            Ok(Poll::Ready(())) => true,
            Err(_) => {
                tracing::error!("a handshake panicked; its client's connection is closed");
                true
            }
        }
    }
}

/// The driver's state: whoever holds it drives.
struct Driving {
    handshakes: Vec<InFlight>,
    /// Accepting paused after `accept(2)` failed.
    paused_until: Option<Instant>,
}

/// A blocking listener's socket and handshakes, driven by its calls.
pub(crate) struct Polling {
    tcp: TcpListener,
    accepting: Arc<Accepting>,
    bell: Arc<Bell>,
    driving: Mutex<Driving>,
    /// Callers that do not drive wait here for their answer or for the turn.
    gate: Mutex<()>,
    turn: Condvar,
    /// A fork()ed child's copies of the handshakes (and of the locks, which a parent thread
    /// may have held at the fork) are the parent's: a child neither drives nor locks them.
    born: Born,
    /// Passes taken (tests look for a driver that spins).
    #[cfg(test)]
    passes: std::sync::atomic::AtomicUsize,
    /// `accept(2)` calls to fail with `EMFILE` (tests).
    #[cfg(test)]
    fail_accepts: std::sync::atomic::AtomicUsize,
}

/// The turn to drive: whoever holds one drives. Giving it back (also when unwinding) tells the
/// callers waiting at the gate, so that one of them takes the turn or sees its answer.
struct Turn<'a> {
    /// Dropped first (fields drop in order): the turn is free before the waiters hear of it.
    d: MutexGuard<'a, Driving>,
    _told: TellWaiters<'a>,
}

/// Tells the callers waiting at the gate when dropped.
struct TellWaiters<'a>(&'a Polling);

impl Drop for TellWaiters<'_> {
    fn drop(&mut self) {
        self.0.tell_waiters();
    }
}

impl Polling {
    /// Drives the handshakes of `tcp` (non-blocking: [`crate::transfer::setup::acceptor::bind`])
    /// for `accepting`.
    ///
    /// # Errors
    /// [`Error::Io`] if the eventfd cannot be created.
    pub(crate) fn new(tcp: TcpListener, accepting: Arc<Accepting>) -> Result<Polling> {
        Ok(Polling {
            tcp,
            accepting,
            bell: Arc::new(Bell::new("the listener's eventfd")?),
            driving: Mutex::new(Driving { handshakes: Vec::new(), paused_until: None }),
            gate: Mutex::new(()),
            turn: Condvar::new(),
            born: Born::now(),
            #[cfg(test)]
            passes: Default::default(),
            #[cfg(test)]
            fail_accepts: Default::default(),
        })
    }

    /// Whether the listener lives in the process that bound it (not in a fork()ed child).
    fn here(&self) -> bool {
        self.born.here()
    }

    /// The turn to drive, unless another caller has it.
    fn try_turn(&self) -> Option<Turn<'_>> {
        self.driving.try_lock().map(|d| Turn { d, _told: TellWaiters(self) })
    }

    /// The shared accepting state.
    pub(crate) fn accepting(&self) -> &Arc<Accepting> {
        &self.accepting
    }

    /// An accept call: offers `blob` and waits for the answer, driving the handshakes while no
    /// other caller does. Once it returns or unwinds, no handshake takes its offer.
    ///
    /// # Errors
    /// The answer's (see [`crate::transfer::Listener::accept_with`]); [`Error::Forked`] in a
    /// fork()ed child (its handshakes are the parent's, and a parent thread may have held
    /// their locks); [`Error::Protocol`] if the handshake ended without answering (a panic:
    /// it dropped the sender).
    pub(crate) fn accept(&self, blob: &[u8]) -> Result<Established> {
        self.accept_by(blob, None)
    }

    /// [`Polling::accept`], giving up after `limit` with [`Error::Timeout`] (the offer is
    /// withdrawn: its `Waiting` guard drops, so no handshake answers it).
    pub(crate) fn accept_by(&self, blob: &[u8], limit: Option<Duration>) -> Result<Established> {
        self.born.check("this listener")?;
        // A limit too far to add is no limit.
        let deadline = limit.and_then(|l| Some((Instant::now().checked_add(l)?, l)));
        let (reply, rx, _waiting) = Reply::blocking();
        self.accepting.offer(blob.to_vec(), reply);
        self.wait(&rx, deadline)
    }

    /// Waits for the answer on `rx`, driving the handshakes while no other caller does, until
    /// `deadline`.
    fn wait(&self, rx: &Receiver<Result<Established>>, deadline: Option<(Instant, Duration)>) -> Result<Established> {
        let answer = |rx: &Receiver<Result<Established>>| match rx.try_recv() {
            Ok(r) => Some(r),
            Err(TryRecvError::Disconnected) => Some(Err(no_answer())),
            Err(TryRecvError::Empty) => None,
        };
        let expired =
            || deadline.filter(|(d, _)| Instant::now() >= *d).map(|(_, l)| Err(Error::Timeout(l, "a client")));
        loop {
            if let Some(mut turn) = self.try_turn() {
                // Giving the turn back (the drop) lets a waiting caller take it.
                return loop {
                    if let Some(r) = answer(rx) {
                        break r;
                    }
                    if let Some(e) = expired() {
                        break e;
                    }
                    self.pass(&mut turn.d, true, deadline.map(|(d, _)| d));
                };
            }
            let mut g = self.gate.lock();
            // Under the gate: an answer or the end of a turn after this look is told below.
            if let Some(r) = answer(rx) {
                return r;
            }
            if let Some(e) = expired() {
                return e;
            }
            if self.driving.is_locked() {
                match deadline {
                    Some((d, _)) => drop(self.turn.wait_until(&mut g, d)),
                    None => self.turn.wait(&mut g),
                }
            }
        }
    }

    /// One pass that does not wait, unless another caller drives (the gauges' look), and the
    /// shared state to read; none in a fork()ed child (nothing there is its own).
    pub(crate) fn progress(&self) -> Option<&Accepting> {
        if !self.here() {
            return None;
        }
        if let Some(mut turn) = self.try_turn() {
            self.pass(&mut turn.d, false, None);
        }
        Some(&self.accepting)
    }

    /// Wakes the callers waiting for their answer or the turn.
    fn tell_waiters(&self) {
        let _g = self.gate.lock();
        self.turn.notify_all();
    }

    /// One round: waits (with `wait`) until a socket has events, the bell rang or a handshake's
    /// time came; takes new clients while there is room; polls the handshakes that can go on.
    fn pass(&self, d: &mut Driving, wait: bool, until: Option<Instant>) {
        #[cfg(test)]
        self.passes.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        // A pause after a failed accept(2) ends once passed (else its time, in the past, would
        // make every later wait a zero timeout).
        d.paused_until = d.paused_until.filter(|t| now < *t);
        let room = self.accepting.in_flight() < self.accepting.max_handshakes() && d.paused_until.is_none();
        let mut fds = Vec::with_capacity(2 + d.handshakes.len());
        fds.push(libc::pollfd { fd: self.bell.fd(), events: libc::POLLIN, revents: 0 });
        fds.push(libc::pollfd { fd: self.tcp.as_raw_fd(), events: if room { libc::POLLIN } else { 0 }, revents: 0 });
        for h in &d.handshakes {
            fds.push(libc::pollfd { fd: h.fd, events: h.slot.interest.load(Ordering::Relaxed), revents: 0 });
        }
        let timeout = if wait {
            let next = d.handshakes.iter().map(InFlight::wake_at).chain(d.paused_until).chain(until).min();
            next.map_or(-1, |t| {
                let ms = t.saturating_duration_since(now).as_micros().div_ceil(1000);
                ms.min(i32::MAX as u128) as i32
            })
        } else {
            0
        };
        // SAFETY: `fds` is a live array of `fds.len()` pollfds, each on a descriptor this
        // listener owns (the bell, the socket, the handshakes' sockets).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            // EINTR (a signal): the handshakes are looked at anyway, below.
            fds.iter_mut().for_each(|p| p.revents = 0);
        }
        if fds[0].revents != 0 {
            self.bell.drain();
        }
        let polled = d.handshakes.len();
        if room {
            self.take_clients(d);
        }
        let now = Instant::now();
        let mut i = 0;
        d.handshakes.retain_mut(|h| {
            let revents = if i < polled { fds[2 + i].revents } else { 0 };
            i += 1;
            !(h.due(revents, now) && h.poll())
        });
        // Answers may have gone to callers waiting at the gate.
        self.tell_waiters();
    }

    /// Takes the clients waiting in the backlog, while there is room.
    fn take_clients(&self, d: &mut Driving) {
        while let Some(ticket) = self.accepting.admit() {
            match self.accept_tcp() {
                Ok((s, peer)) => {
                    if let Some(h) = self.start(s, peer, ticket) {
                        d.handshakes.push(h);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // EMFILE and friends: say so, let some handshakes finish, go on.
                    tracing::warn!("accepting a TCP connection failed: {e}");
                    d.paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                    break;
                }
            }
        }
    }

    /// `accept(2)` on the listening socket (tests make it fail with `EMFILE`).
    fn accept_tcp(&self) -> std::io::Result<(TcpStream, SocketAddr)> {
        #[cfg(test)]
        if self.fail_accepts.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
            return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
        }
        self.tcp.accept()
    }

    /// A handshake on a new client's stream (polled at once by the pass); none if its socket
    /// cannot be set up (the client is closed, its slot given back).
    fn start(&self, s: TcpStream, peer: SocketAddr, ticket: Ticket) -> Option<InFlight> {
        if let Err(e) = s.set_nonblocking(true).and_then(|()| s.set_nodelay(true)) {
            tracing::warn!(%peer, "setting up an accepted TCP connection failed ({e}); closed");
            return None;
        }
        let deadline = self.accepting.deadline();
        let slot = Arc::new(Slot {
            interest: AtomicI16::new(0),
            timer: Mutex::new(None),
            woken: AtomicBool::new(true),
            bell: self.bell.clone(),
        });
        let fd = s.as_raw_fd();
        let wire = Polled { s, deadline, slot: slot.clone() };
        let run = Box::pin(self.accepting.clone().handshake(wire, peer, deadline, ticket));
        Some(InFlight { fd, deadline: deadline.at(), waker: Waker::from(slot.clone()), slot, run })
    }
}

impl Drop for Polling {
    fn drop(&mut self) {
        if !self.here() {
            // A fork()ed child: the handshakes (their queue pairs) are the parent's, not this
            // child's to destroy. No lock: a parent thread may have held it at the fork.
            std::mem::forget(std::mem::take(&mut self.driving.get_mut().handshakes));
        }
        // The handshakes close with the listener; the port is free after.
    }
}

#[cfg(test)]
#[path = "polling_tests.rs"]
mod tests;
