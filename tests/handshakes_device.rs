//! TCP listeners under slow and excess clients: handshakes run side by side, each within one
//! deadline, at most `max_handshakes` at once.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{assert_bytes_eq, open, pattern};
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, Options};
use mralloc::verbs::Pd;

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
    let listener =
        Listener::bind("127.0.0.1:0", &pd, Options { connect_timeout: limit, ..Options::default() }).unwrap();
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
        std::thread::sleep(Duration::from_millis(1500)); // All 200 are in flight now.
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
        // The slow clients: each closed by the server once its deadline passed.
        let mut slow = trickle.join().unwrap();
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
    let opts = Options { max_handshakes: 4, connect_timeout: Duration::from_secs(30), ..Options::default() };
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let held: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(500));
    println!("at the bound: {listener:?}");
    std::thread::scope(|s| {
        let server = s.spawn(|| loop {
            // The held handshakes' failures (their clients leave) may come first: skip them.
            match listener.accept() {
                Ok(c) => return c,
                Err(e) => println!("  a held handshake's end: {e}"),
            }
        });
        let t = Instant::now();
        let (pd, copts) = (&pd, opts.clone());
        let client = s.spawn(move || Connection::connect(addr, pd, copts).map(|_| t.elapsed()));
        std::thread::sleep(Duration::from_secs(2));
        assert!(!client.is_finished(), "a fifth handshake ran while four held the slots");
        drop(held); // The held clients leave; their slots free up.
        let took = client.join().unwrap().expect("the waiting client connects once a slot is free");
        println!("the fifth client connected after {took:?} (the slots were held for 2 s)");
        assert!(took >= Duration::from_secs(2));
        let _srv = server.join().unwrap();
    });
}
