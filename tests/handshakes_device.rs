//! TCP listeners under slow and excess clients: handshakes run side by side, each within one
//! deadline, at most `max_handshakes` at once.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{assert_bytes_eq, open, pattern, wait_for};
use mralloc::heap::Heap;
use mralloc::transfer::{CmListener, Connection, Listener, Options, SetupOptions};
use mralloc::verbs::Pd;
use mralloc::Error;

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).build().unwrap();
    (pd, heap)
}

/// Whether the server closed `s` (EOF or reset) within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue, // A refusal message, then the close.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// 200 clients trickle one byte a second; a real client connects meanwhile, at once. The slow
/// ones are dropped when their handshake's deadline passes.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_slow_handshakes_hold_up_nobody() {
    let (pd, heap) = setup();
    let limit = Duration::from_secs(6);
    let listener = Listener::bind(
        "127.0.0.1:0",
        &pd,
        Options { setup: SetupOptions { connect_timeout: limit, ..Default::default() }, ..Options::default() },
    )
    .unwrap();
    let addr = listener.local_addr().unwrap();
    let mut slow: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let opened = Instant::now();
    let magic = b"mRdx";
    std::thread::scope(|s| {
        let trickle = s.spawn(|| {
            // One byte a second to each, until their deadline has passed.
            let mut i = 0;
            while opened.elapsed() < limit + Duration::from_secs(1) {
                for c in &mut slow {
                    let _ = c.write_all(&magic[i % 4..i % 4 + 1]);
                }
                i += 1;
                std::thread::sleep(Duration::from_secs(1));
            }
            slow
        });
        // All 200 handshakes are running before the real client comes.
        wait_for("200 handshakes in flight", Duration::from_secs(30), || listener.handshakes_in_flight() == 200);
        let server = s.spawn(|| {
            let conn = listener.accept_with(b"welcome").unwrap();
            let mut inbox = heap.alloc(4096).unwrap();
            assert_eq!(conn.recv(&mut inbox).unwrap().len, 4096);
            assert_bytes_eq(&inbox, &pattern(21, 4096), "the real client's message");
        });
        let t = Instant::now();
        let conn = Connection::connect(addr, &pd, Options::default()).unwrap();
        let took = t.elapsed();
        println!("real client connected in {took:?} with 200 slow handshakes in flight ({listener:?})");
        assert!(took < Duration::from_secs(2), "took {took:?}");
        assert_eq!(conn.peer_blob(), b"welcome");
        let mut msg = heap.alloc(4096).unwrap();
        msg.copy_from_slice(&pattern(21, 4096));
        conn.send(&msg).unwrap();
        server.join().unwrap();
        // The slow clients: each closed by the server once its deadline passed (at the next call
        // on the listener: it has no thread of its own; the gauge takes a pass).
        let mut slow = trickle.join().unwrap();
        wait_for("the slow handshakes ended", Duration::from_secs(30), || listener.handshakes_in_flight() == 0);
        let dropped =
            slow.iter_mut().map(|c| closed_within(c, Duration::from_secs(3))).filter(|&closed| closed).count();
        println!(
            "slow clients closed by the server after their {limit:?} deadline: {dropped}/200 at {:?}",
            opened.elapsed()
        );
        assert_eq!(dropped, 200);
    });
}

/// At `max_handshakes` the listener takes no more TCP connections: further clients wait in the
/// kernel's backlog, and are served as soon as a slot frees up.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_handshakes_beyond_the_bound_wait_their_turn() {
    let (pd, _heap) = setup();
    let opts = Options {
        setup: SetupOptions { max_handshakes: 4, connect_timeout: Duration::from_secs(30), ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let held: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    wait_for("4 handshakes in flight", Duration::from_secs(30), || listener.handshakes_in_flight() == 4);
    println!("at the bound: {listener:?}");
    std::thread::scope(|s| {
        // The held clients' ends never end the accept call (the listener records them).
        let server = s.spawn(|| listener.accept().expect("the waiting client's connection"));
        let t = Instant::now();
        let (pd, copts) = (&pd, opts.clone());
        let client = s.spawn(move || Connection::connect(addr, pd, copts).map(|_| t.elapsed()));
        // An observation window, not a stand-in: nothing may change for 2 s.
        std::thread::sleep(Duration::from_secs(2));
        assert!(!client.is_finished(), "a fifth handshake ran while four held the slots");
        assert_eq!(listener.handshakes_in_flight(), 4, "the bound held");
        drop(held); // The held clients leave; their slots free up.
        let took = client.join().unwrap().expect("the waiting client connects once a slot is free");
        println!("the fifth client connected after {took:?} (the slots were held for 2 s)");
        assert!(took >= Duration::from_secs(2));
        let _srv = server.join().unwrap();
    });
}

/// A raw RDMA CM client (librdmacm, no QP of its own): sends one connect request and never
/// confirms the answer, as a hostile or crashed-midway client does.
struct RawCm {
    ch: *mut rdma_sys::rdma_event_channel,
    id: *mut rdma_sys::rdma_cm_id,
}

impl RawCm {
    /// `qp_num` must differ between clients: the CM rejects a second request naming the same
    /// remote QP as a stale connection.
    fn request(ip: &str, port: u16, private: &[u8], qp_num: u32) -> RawCm {
        use rdma_sys as ffi;
        // SAFETY: plain librdmacm calls on objects created here; every event is acknowledged.
        unsafe {
            let ch = ffi::rdma_create_event_channel();
            assert!(!ch.is_null());
            let mut id = std::ptr::null_mut();
            assert_eq!(ffi::rdma_create_id(ch, &mut id, std::ptr::null_mut(), ffi::rdma_port_space::RDMA_PS_TCP), 0);
            let me = RawCm { ch, id };
            let addr: std::net::SocketAddrV4 = format!("{ip}:{port}").parse().unwrap();
            let mut sin: libc::sockaddr_in = std::mem::zeroed();
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = port.to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(addr.ip().octets());
            assert_eq!(
                ffi::rdma_resolve_addr(id, std::ptr::null_mut(), (&mut sin as *mut libc::sockaddr_in).cast(), 2000),
                0
            );
            assert_eq!(me.next(Duration::from_secs(5)), Some(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED));
            assert_eq!(ffi::rdma_resolve_route(id, 2000), 0);
            assert_eq!(me.next(Duration::from_secs(5)), Some(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED));
            let mut param: ffi::rdma_conn_param = std::mem::zeroed();
            param.private_data = private.as_ptr().cast();
            param.private_data_len = private.len() as u8;
            param.responder_resources = 1;
            param.initiator_depth = 1;
            param.retry_count = 7;
            param.rnr_retry_count = 7;
            param.qp_num = qp_num;
            assert_eq!(ffi::rdma_connect(id, &mut param), 0);
            me
        }
    }

    /// The kind of the next event within `within`.
    fn next(&self, within: Duration) -> Option<u32> {
        // SAFETY: our live channel; the event is acknowledged at once.
        unsafe {
            let mut pfd = libc::pollfd { fd: (*self.ch).fd, events: libc::POLLIN, revents: 0 };
            if libc::poll(&mut pfd, 1, within.as_millis() as i32) != 1 {
                return None;
            }
            let mut ev = std::ptr::null_mut();
            assert_eq!(rdma_sys::rdma_get_cm_event(self.ch, &mut ev), 0);
            let kind = (*ev).event;
            rdma_sys::rdma_ack_cm_event(ev);
            Some(kind)
        }
    }
}

impl Drop for RawCm {
    fn drop(&mut self) {
        // SAFETY: created in `request`, destroyed once.
        unsafe {
            rdma_sys::rdma_destroy_id(self.id);
            rdma_sys::rdma_destroy_event_channel(self.ch);
        }
    }
}

/// The CM ids naming `port` (listening, accepted or connecting), as the kernel sees them.
fn cm_ids_on(port: u16) -> usize {
    common::rdma_res("cm_id").lines().filter(|l| l.contains(&format!(":{port} "))).count()
}

/// Garbage and half-open RDMA CM requests while accept calls run side by side: the garbage is
/// rejected at once, the half-open ones when their accept's deadline passes, a real client
/// connects meanwhile, and no CM id or QP is left of any of them.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_cm_listener_rejects_garbage_and_half_open_requests_and_leaks_nothing() {
    use rdma_sys::rdma_cm_event_type as T;
    let ip = std::env::var("MRALLOC_CM_ADDR").expect("MRALLOC_CM_ADDR (scripts/softroce sets it)");
    let (pd, _heap) = setup();
    let port = 30000 + (std::process::id() % 10000) as u16;
    let limit = Duration::from_secs(3);
    let listener = CmListener::bind(
        (ip.as_str(), port),
        &pd,
        Options { setup: SetupOptions { connect_timeout: limit, ..Default::default() }, ..Options::default() },
    )
    .unwrap();
    let qps_before = common::resources("qp", &common::our_pdns());
    // Accept calls that never return would hang the scope below: fail the process instead.
    let (alive, watchdog) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = watchdog.recv_timeout(Duration::from_secs(120)) {
            eprintln!("device_cm_listener_rejects_garbage_and_half_open_requests_and_leaks_nothing hung; exiting");
            std::process::exit(3);
        }
    });
    const GARBAGE: usize = 4;
    const HALF_OPEN: usize = 8;
    let (results, raw_events, real) = std::thread::scope(|s| {
        // One accept call per request, all at once.
        let accepts: Vec<_> = (0..GARBAGE + HALF_OPEN + 1)
            .map(|_| s.spawn(|| listener.accept_with(b"hi").map(|c| c.peer_blob().to_vec())))
            .collect();
        let garbage: Vec<RawCm> =
            (0..GARBAGE).map(|i| RawCm::request(&ip, port, &[200, 1, 2], 0x4200 + i as u32)).collect();
        // Well-formed private data (the rights byte, granting nothing, and an empty blob).
        let half: Vec<RawCm> =
            (0..HALF_OPEN).map(|i| RawCm::request(&ip, port, &[0xe0, 0], 0x4300 + i as u32)).collect();
        let t = Instant::now();
        let c = Connection::connect_cm_with((ip.as_str(), port), &pd, Options::default(), b"real").unwrap();
        let real = (t.elapsed(), c.peer_blob().to_vec());
        drop(c);
        let mut events = Vec::new();
        for g in &garbage {
            events.push(("garbage", g.next(Duration::from_secs(2))));
        }
        for h in &half {
            // The server answered (it cannot tell before), then gave up at its deadline.
            events.push(("half-open answer", h.next(Duration::from_secs(5))));
            events.push(("half-open end", h.next(limit + Duration::from_secs(5))));
        }
        let results: Vec<_> = accepts.into_iter().map(|a| a.join().unwrap()).collect();
        drop((garbage, half));
        (results, events, real)
    });
    println!("cm: real client connected in {:?}; raw clients saw {raw_events:?}", real.0);
    assert_eq!(real.1, b"hi");
    assert!(real.0 < Duration::from_secs(2), "the real client waited {:?}", real.0);
    for (what, e) in &raw_events {
        match *what {
            "garbage" => assert_eq!(*e, Some(T::RDMA_CM_EVENT_REJECTED), "garbage is rejected at once"),
            "half-open answer" => assert_eq!(*e, Some(T::RDMA_CM_EVENT_CONNECT_RESPONSE)),
            _ => assert!(
                matches!(*e, Some(k) if k == T::RDMA_CM_EVENT_REJECTED || k == T::RDMA_CM_EVENT_DISCONNECTED || k == T::RDMA_CM_EVENT_CONNECT_ERROR),
                "a half-open client is let go at the deadline: {e:?}"
            ),
        }
    }
    let ok = results.iter().filter(|r| r.as_ref().is_ok_and(|b| b == b"real")).count();
    let protocol = results.iter().filter(|r| matches!(r, Err(Error::Protocol(_)))).count();
    let timeouts = results.iter().filter(|r| matches!(r, Err(Error::Timeout(..)))).count();
    assert_eq!((ok, protocol, timeouts), (1, GARBAGE, HALF_OPEN), "{results:?}");
    // Nothing left but the listener: no accepted, rejected or timed-out id, no QP.
    let deadline = Instant::now() + Duration::from_secs(10);
    while cm_ids_on(port) > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(cm_ids_on(port), 1, "only the listener's CM id is left:\n{}", common::rdma_res("cm_id"));
    assert_eq!(common::resources("qp", &common::our_pdns()), qps_before, "no QP left");
    drop(listener);
    assert_eq!(cm_ids_on(port), 0);
    drop(alive);
}

/// A server written like the docs (`loop { let conn = listener.accept()?; ... }`) survives
/// clients that connect and close at once, send garbage, or say nothing: the accept call that is
/// waiting meanwhile returns the next real client's connection, and the listener counts and keeps
/// the failures.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_failed_clients_never_end_an_accept_call() {
    let (pd, _heap) = setup();
    let opts = Options {
        setup: SetupOptions { connect_timeout: Duration::from_secs(2), ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept_with(b"real"));
        // Bare connect-and-close, garbage, and a silent client (cut by the 2 s timeout).
        drop(TcpStream::connect(addr).unwrap());
        TcpStream::connect(addr).unwrap().write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let silent = TcpStream::connect(addr).unwrap();
        let start = Instant::now();
        while listener.failed_handshakes() < 3 {
            assert!(start.elapsed() < Duration::from_secs(30), "failures counted: {}", listener.failed_handshakes());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!server.is_finished(), "a failed client ended the accept call");
        drop(silent);
        let conn = Connection::connect(addr, &pd, opts.clone()).unwrap();
        assert_eq!(conn.peer_blob(), b"real");
        let got = server.join().unwrap().expect("the accept call returns the real client");
        assert_eq!(got.peer_blob(), b"");
        let failures = listener.take_handshake_failures();
        println!("{} failed clients: {failures:?}", listener.failed_handshakes());
        assert_eq!(failures.len(), 3);
        assert!(failures.iter().all(|f| f.peer.ip().is_loopback()));
    });
}

/// A client that took an accept call's blob (its hello arrived, this side answered with its
/// QP's endpoint and the blob) and then went away: the accept call goes on waiting, with the
/// same blob, and returns the next real client.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_client_leaving_after_the_welcome_leaves_the_accept_call_waiting() {
    let (pd, _heap) = setup();
    let hello = common::captured_hello(&pd);
    let opts = Options {
        setup: SetupOptions { connect_timeout: Duration::from_secs(5), ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept_with(b"the blob"));
        // A well-formed hello; read the welcome (it carries the blob); leave without Ready.
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(&hello).unwrap();
        let mut welcome = [0u8; 16];
        c.read_exact(&mut welcome).unwrap();
        drop(c);
        let failure = common::next_handshake_failure(&listener);
        println!("the leaving client: {:?}", failure.error);
        assert!(matches!(failure.error, Error::Io { .. }), "{:?}", failure.error);
        assert!(!server.is_finished(), "the leaving client ended the accept call");
        let conn = Connection::connect(addr, &pd, opts.clone()).unwrap();
        assert_eq!(conn.peer_blob(), b"the blob", "the accept call's blob, offered again");
        server.join().unwrap().expect("the accept call returns the real client");
        assert_eq!(listener.failed_handshakes(), 1);
    });
}

/// Two accept calls at once on one blocking listener (it has no thread: one call drives the
/// handshakes, the other waits for its answer or its turn), with a silent client in flight: the
/// first accept call returns the first client, and the second call — now the one that must
/// drive — the second client; the silent client holds up neither and is dropped at its
/// deadline, counted.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_two_accept_calls_take_turns_and_a_silent_client_holds_up_neither() {
    let (pd, _heap) = setup();
    let opts = Options {
        setup: SetupOptions { connect_timeout: Duration::from_secs(4), ..Default::default() },
        ..Options::default()
    };
    let listener = std::sync::Arc::new(Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap());
    let addr = listener.local_addr().unwrap();
    let mut silent = TcpStream::connect(addr).unwrap();
    wait_for("the silent client in flight", Duration::from_secs(30), || listener.handshakes_in_flight() == 1);
    let accept = |blob: &'static [u8]| {
        let l = listener.clone();
        std::thread::spawn(move || l.accept_with(blob).map(|c| c.peer_blob().to_vec()))
    };
    let first = accept(b"first");
    std::thread::sleep(Duration::from_millis(300)); // The first call is the one driving.
    let second = accept(b"second");
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let a = Connection::connect(addr, &pd, opts.clone()).expect("the first real client connects");
    assert_eq!(a.peer_blob(), b"first");
    // Threads, not a scope: a call that never returns fails the test instead of hanging it.
    let b = Connection::connect(addr, &pd, opts.clone()).expect("the second real client connects");
    assert_eq!(a.peer_blob(), b"first");
    assert_eq!(b.peer_blob(), b"second", "the waiting accept call drove once the first returned");
    let took = started.elapsed();
    println!("two clients through two accept calls in {took:?}, a silent client in flight");
    assert!(took < Duration::from_secs(3), "the silent client held them up: {took:?}");
    wait_for("both accept calls returned", Duration::from_secs(10), || first.is_finished() && second.is_finished());
    assert_eq!(first.join().unwrap().unwrap(), b"");
    assert_eq!(second.join().unwrap().unwrap(), b"");
    // The silent client: closed and counted once its deadline passed (at the next call).
    wait_for("the silent client's failure", Duration::from_secs(30), || listener.failed_handshakes() == 1);
    let failure = listener.take_handshake_failures().remove(0);
    assert!(matches!(failure.error, Error::Io { .. }), "{:?}", failure.error);
    assert!(closed_within(&mut silent, Duration::from_secs(3)), "the silent client was not closed");
    assert_eq!(listener.handshakes_in_flight(), 0);
}

/// The same for RDMA CM: a connect the peer's CM rejects because nothing listens yet is tried
/// again until `connect_timeout`; with nobody listening it ends at that deadline, typed.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_cm_client_started_before_its_listener_connects_once_it_listens() {
    let ip = std::env::var("MRALLOC_CM_ADDR").expect("MRALLOC_CM_ADDR (scripts/softroce sets it)");
    let (pd, heap) = setup();
    let port = 40000 + (std::process::id() % 10000) as u16;
    let client = std::thread::spawn({
        let (pd, ip) = (pd.clone(), ip.clone());
        move || {
            let started = Instant::now();
            let conn = Connection::connect_cm((ip.as_str(), port), &pd, Options::default());
            (conn, started.elapsed())
        }
    });
    std::thread::sleep(Duration::from_millis(700));
    assert!(!client.is_finished(), "the rejected CM connect gave up instead of trying again");
    let listener = CmListener::bind((ip.as_str(), port), &pd, Options::default()).unwrap();
    let server = listener.accept().unwrap();
    let (conn, took) = client.join().unwrap();
    let conn = conn.unwrap();
    assert!(took >= Duration::from_millis(700), "{took:?}");
    let msg = heap.alloc(64).unwrap();
    let inbox = server.post_recv(heap.alloc(64).unwrap()).unwrap();
    conn.send(&msg).unwrap();
    assert_eq!(inbox.wait().unwrap().1.len, 64);
    drop((conn, server, listener));
    // Nobody ever listens: the deadline ends it.
    let opts = Options {
        setup: SetupOptions { connect_timeout: Duration::from_millis(1500), ..Default::default() },
        ..Options::default()
    };
    let started = Instant::now();
    let e = Connection::connect_cm((ip.as_str(), port + 1), &pd, opts).unwrap_err();
    let took = started.elapsed();
    println!("CM connect with nobody listening: {e} after {took:?}");
    assert!(matches!(e, Error::Timeout(..)) && e.to_string().contains("nothing listens"), "{e:?}");
    assert!(took >= Duration::from_millis(1400) && took < Duration::from_secs(8), "{took:?}");
}

/// A client may start before its server: a refused TCP connect (nothing listens yet) is tried
/// again until `connect_timeout`; one that nobody ever answers fails once that deadline passed.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_client_started_before_its_server_connects_once_it_listens() {
    let (pd, heap) = setup();
    // A port nothing listens on (taken, then let go).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let client = std::thread::spawn({
        let pd = pd.clone();
        move || {
            let started = Instant::now();
            let conn = Connection::connect(addr, &pd, Options::default());
            (conn, started.elapsed())
        }
    });
    std::thread::sleep(Duration::from_millis(700));
    assert!(!client.is_finished(), "the refused connect gave up instead of trying again");
    let listener = Listener::bind(addr, &pd, Options::default()).unwrap();
    let server = listener.accept().unwrap();
    let (conn, took) = client.join().unwrap();
    let conn = conn.unwrap();
    assert!(took >= Duration::from_millis(700), "{took:?}");
    let mut msg = heap.alloc(64).unwrap();
    msg.copy_from_slice(&pattern(5, 64));
    let mut inbox = heap.alloc(64).unwrap();
    std::thread::scope(|s| {
        let r = s.spawn(|| server.recv(&mut inbox).unwrap());
        conn.send(&msg).unwrap();
        assert_eq!(r.join().unwrap().len, 64);
    });
    assert_bytes_eq(&inbox, &msg, "the message over the late server's connection");
    drop((conn, server, listener));
    // Nobody ever listens: the deadline ends it, a timeout saying nothing listened (as the RDMA
    // CM connect reports it).
    let opts = Options {
        setup: SetupOptions { connect_timeout: Duration::from_millis(800), ..Default::default() },
        ..Options::default()
    };
    let started = Instant::now();
    let e = Connection::connect(addr, &pd, opts).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, Error::Timeout(..)) && e.to_string().contains("nothing listens"), "{e:?}");
    assert!(took >= Duration::from_millis(700) && took < Duration::from_secs(5), "{took:?}");
}
