//! The blocking listener's driver on a real device (the Soft-RoCE VM: a listener needs a PD),
//! stopped before any queue pair is made: a driver that spins (counted in passes), a client
//! that resets while it waits for an accept call, a failed `accept(2)`, a fork()ed child that
//! drops the listener while a parent thread drives it.

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Polling;
use crate::error::{Error, Result};
use crate::transfer::setup::acceptor::{self, Accepting};
use crate::transfer::setup::control::Established;
use crate::transfer::setup::exchange::{Kind, Message};
use crate::transfer::Options;
use crate::verbs::{Context, Endpoint, Gid, Mtu, Pd};

/// A listener on loopback whose handshakes last 30 s, leaked (the child of a fork drops it
/// while the parent's driver still refers to it).
fn listener() -> (&'static Polling, std::net::SocketAddr) {
    let pd = Pd::new(&Context::open_default().expect("an RDMA device")).unwrap();
    let mut opts = Options::default();
    opts.setup.connect_timeout = Duration::from_secs(30);
    let (tcp, addr) = acceptor::bind("127.0.0.1:0").unwrap();
    let p = Polling::new(tcp, Accepting::new(&pd, &opts, false)).unwrap();
    (Box::leak(Box::new(p)), addr)
}

/// A thread that drives `p` until told to stop (by the returned sender and the bell).
fn drive(p: &'static Polling) -> (SyncSender<Result<Established>>, JoinHandle<()>) {
    let (tx, rx) = sync_channel(1);
    let driver = std::thread::spawn(move || assert!(matches!(p.wait(&rx, None), Err(Error::Closed))));
    (tx, driver)
}

fn stop(p: &'static Polling, (tx, driver): (SyncSender<Result<Established>>, JoinHandle<()>)) {
    tx.send(Err(Error::Closed)).unwrap();
    p.bell.ring();
    driver.join().unwrap();
}

/// Waits (up to 20 s: the VM is slow) for `cond`.
fn eventually(what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Passes the driver takes in `d` with nothing new to do.
fn passes_over(p: &Polling, d: Duration) -> usize {
    let before = p.passes.load(Ordering::Relaxed);
    std::thread::sleep(d);
    p.passes.load(Ordering::Relaxed) - before
}

/// A well-formed hello (its endpoint is never connected to: no accept call comes).
fn hello() -> Vec<u8> {
    let ep = Endpoint { qpn: 7, psn: 7, gid: Gid::from_bytes([0; 16]), lid: 0, mtu: Mtu::Mtu1024 };
    Message::new(Kind::Hello, Some(ep), Vec::new()).encode().unwrap()
}

/// Closes `s` with a reset (SO_LINGER 0).
fn reset(s: TcpStream) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: sets an option on a socket `s` owns, from a live `linger` of the size given.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0);
    drop(s);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn a_client_resetting_while_it_waits_for_an_accept_call_fails_at_once_and_nobody_spins() {
    let (p, addr) = listener();
    let driving = drive(p);
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(&hello()).unwrap();
    // Its hello heard, the handshake waits for an accept call (none comes): the driver sleeps.
    eventually("the client's handshake", || p.accepting.in_flight() == 1);
    std::thread::sleep(Duration::from_millis(500));
    assert!(passes_over(p, Duration::from_secs(1)) < 20, "the driver spins while a client waits");
    reset(c);
    eventually("the client's failure", || p.accepting.failed_total() == 1);
    assert_eq!(p.accepting.in_flight(), 0);
    let failures = p.accepting.take_failures();
    assert!(matches!(failures[0].error, Error::Protocol(_)), "{:?}", failures[0].error);
    assert!(passes_over(p, Duration::from_secs(1)) < 20, "the driver spins after the client left");
    stop(p, driving);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn a_failed_accept_pauses_accepting_for_a_while_and_then_the_driver_sleeps_again() {
    let (p, addr) = listener();
    p.fail_accepts.store(1, Ordering::Relaxed);
    let driving = drive(p);
    // A silent client: its accept(2) fails once (EMFILE), then it is taken after the pause
    // and its handshake waits for its hello, 30 s.
    let _c = TcpStream::connect(addr).unwrap();
    eventually("the client taken after the pause", || p.accepting.in_flight() == 1);
    assert_eq!(p.fail_accepts.load(Ordering::Relaxed), 0, "the failure was injected");
    assert!(passes_over(p, Duration::from_secs(1)) < 20, "the driver spins once the pause passed");
    stop(p, driving);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn a_forked_child_drops_the_listener_its_parent_drives_and_takes_no_pass() {
    let (p, addr) = listener();
    let driving = drive(p);
    let _c = TcpStream::connect(addr).unwrap();
    eventually("the client's handshake", || p.accepting.in_flight() == 1);
    eventually("a driver in its turn", || p.driving.is_locked());
    // SAFETY: fork(2); the child only runs the code below and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // The child: the driver's lock is held (by a thread that is not here).
        let forked = matches!(p.accept(&[]), Err(Error::Forked(_)));
        let passes = p.passes.load(Ordering::Relaxed);
        let no_pass = p.progress().is_none() && p.passes.load(Ordering::Relaxed) == passes;
        // SAFETY: `p` was leaked from a Box; in the child only this thread exists, so the
        // parent's driver, which refers to it, never runs here again.
        drop(unsafe { Box::from_raw(p as *const Polling as *mut Polling) });
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(if forked && no_pass { 0 } else { 1 }) };
    }
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let mut status = 0;
        // SAFETY: waits for our own child, without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break Some(status);
        }
        if Instant::now() >= until {
            // SAFETY: kills and reaps our own child, stuck.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let status = status.expect("the child dropping the listener got stuck (its driver's lock)");
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
    // The parent's handshake is untouched.
    assert_eq!(p.accepting.in_flight(), 1);
    stop(p, driving);
}
