//! Reliability under load, faults and bad input, on a real device (the VM). Run by scripts/test.
//! Every test is bounded in operations and time and stops by itself.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, DeviceChoice, Listener, Options, QpOptions, SetupOptions};
use mralloc::verbs::{Access, Pd, WcStatus};
use mralloc::{Disconnect, Error, RemoteBuf};

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).max_chunk(16 << 20).build().unwrap();
    (pd, heap)
}

/// 2 threads x 8 connections, mixed alloc/free/write/read/send of random sizes, every transfer
/// checksummed; afterwards no live bytes, and no QP or MR beyond what the heap retains.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_stress_two_threads_eight_connections() {
    let (pd, heap) = setup();
    let pdns = our_pdns();
    assert!(!pdns.is_empty(), "the resource tracker lists this process's PD");
    let qps_before = resources("qp", &pdns);
    let probe = Connection::pair(&pd, &Options::default()).unwrap();
    let with_probe = resources("qp", &pdns);
    println!("PDs {pdns:?}: QPs {qps_before} before, {with_probe} with one pair; MRs {}", resources("mr", &pdns));
    assert_eq!(with_probe, qps_before + 2, "the resource count sees this process's QPs");
    drop(probe);
    let (mut moved, mut ops) = (0u64, 0u64);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u64)
            .map(|t| {
                let (pd, heap) = (&pd, &heap);
                s.spawn(move || {
                    let opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
                    let pairs: Vec<_> = (0..4).map(|_| Connection::pair(pd, &opts).unwrap()).collect();
                    let mut rng = Rng(0xfeed + t);
                    let mut held = Vec::new();
                    let (mut moved, mut ops) = (0u64, 0u64);
                    for i in 0..300 {
                        let (a, b) = &pairs[rng.below(pairs.len() as u64) as usize];
                        let cap = if rng.below(10) == 0 { 2 << 20 } else { 64 << 10 };
                        let n = 1 + rng.below(cap) as usize;
                        let mut src = heap.alloc(n).unwrap();
                        src.copy_from_slice(&pattern(t << 32 | i, n));
                        let sum = checksum(&src);
                        match rng.below(3) {
                            0 => {
                                let dst = heap.alloc(n).unwrap().expose().unwrap();
                                a.write(&src, &dst.remote(), 0).unwrap();
                                assert_eq!(checksum(&dst.to_vec()), sum, "write {i}");
                            }
                            1 => {
                                let mut dst = heap.alloc(n).unwrap();
                                a.read(&mut dst, &src.remote().unwrap(), 0).unwrap();
                                assert_eq!(checksum(&dst), sum, "read {i}");
                            }
                            _ => {
                                let p = b.post_recv(heap.alloc(n).unwrap()).unwrap();
                                a.send(&src).unwrap();
                                let (got, r) = p.wait().unwrap();
                                assert_eq!((r.len, checksum(&got)), (n, sum), "send {i}");
                            }
                        }
                        moved += n as u64;
                        ops += 1;
                        // Keep some buffers alive across operations, free others.
                        if rng.below(4) == 0 {
                            held.push(src);
                        }
                        if held.len() > 16 {
                            held.swap_remove(rng.below(held.len() as u64) as usize);
                        }
                    }
                    (moved, ops)
                })
            })
            .collect();
        for h in hs {
            let (m, o) = h.join().unwrap();
            moved += m;
            ops += o;
        }
    });
    let st = heap.stats();
    println!(
        "stress: {ops} operations, {moved} bytes moved and checksummed; heap: {} live bytes, {} chunks, {} registered",
        st.live_bytes, st.chunks, st.registered_bytes[0]
    );
    assert_eq!(st.live_bytes, 0, "every buffer was freed");
    assert_eq!(resources("qp", &pdns), qps_before, "QPs leaked");
    // Every remaining MR is a registered heap chunk (the connections' own regions are gone);
    // each idle release deregistered one.
    let mrs = resources("mr", &pdns) as u64;
    let reg_chunks = st.reg_mr_calls - st.registration_failures - st.idle_releases;
    println!("MRs in this process's PD: {mrs}; registered heap chunks: {reg_chunks}");
    assert_eq!(mrs, reg_chunks, "MRs leaked (or heap chunks not registered)");
    drop(heap);
    assert_eq!(resources("mr", &pdns), 0, "dropping the heap deregisters every chunk");
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
}

/// A peer that sends malformed connection messages gets typed errors; the listener goes on.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_malformed_connection_messages_are_typed_errors() {
    let (pd, _heap) = setup();
    let opts = Options {
        setup: SetupOptions { connect_timeout: Duration::from_secs(2), ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let good = captured_hello(&pd);
    const HEADER: usize = HELLO_LEN;
    let mut wrong_version = good.clone();
    wrong_version[5] = 99;
    let mut huge = good.clone();
    let at = HEADER - 4; // the blob length, the header's last field
    huge[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", [&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..], &[0; HEADER]].concat()),
        ("wrong version", wrong_version),
        ("huge length", huge),
        ("truncated", good[..20].to_vec()),
        ("silent", Vec::new()),
    ];
    for (what, bytes) in cases {
        let (done, wait_done) = std::sync::mpsc::channel::<()>();
        // Before the client connects: the handshake's deadline starts when it is accepted.
        let t = Instant::now();
        let h = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&bytes).unwrap();
            if what == "truncated" {
                drop(s); // close mid-message
            } else {
                // Keep the socket open until the server gave up on it (at most a minute): only
                // the server's own connect timeout can end a silent peer's accept.
                let _ = wait_done.recv_timeout(Duration::from_secs(60));
            }
        });
        // The client's failure is recorded by the listener (accept calls never return it).
        let err = next_handshake_failure(&listener).error;
        let took = t.elapsed();
        let _ = done.send(()); // (the "truncated" client is gone already)
        println!("{what}: {err} (after {took:?})");
        match what {
            "silent" => {
                // The 2 s connect timeout itself fired: a timed-out read, not the peer's close,
                // and not before the timeout.
                let kind = match &err {
                    Error::Io { source, .. } => source.kind(),
                    other => panic!("silent: {other:?}"),
                };
                assert!(
                    matches!(kind, std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                    "silent: a read timeout, got {kind:?}: {err}"
                );
                assert!(took >= Duration::from_secs(2), "silent: failed after {took:?}, before the 2 s timeout");
            }
            "truncated" => assert!(matches!(err, Error::Io { .. }), "{err:?}"),
            _ => assert!(matches!(err, Error::Protocol(_)), "{what}: {err:?}"),
        }
        assert!(took < Duration::from_secs(30), "bounded by the connect timeout");
        h.join().unwrap();
    }
    // The listener still accepts a real peer.
    std::thread::scope(|s| {
        let c = s.spawn(|| Connection::connect(addr, &pd, opts.clone()).unwrap());
        let server = listener.accept().unwrap();
        let client = c.join().unwrap();
        assert_eq!(server.peer().qpn, client.qp().qpn());
    });
}

/// Bad input: typed errors, nothing posted, nothing lost.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_bad_input_is_typed() {
    let (pd, heap) = setup();
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    let src = heap.alloc(4096).unwrap();
    let dst = heap.alloc(4096).unwrap().expose().unwrap();
    let remote = dst.remote();
    // Overflowing remote ranges.
    let wrap = RemoteBuf { addr: u64::MAX - 10, len: 4096, rkey: remote.rkey };
    assert!(matches!(a.write(&src, &wrap, 0), Err(Error::OutOfBounds { .. })));
    assert!(matches!(a.write(&src, &remote, u64::MAX - 1), Err(Error::OutOfBounds { .. })));
    // A RemoteBuf of another connection's PD: the NIC refuses it, typed.
    let other_pd = Pd::new(pd.context()).unwrap();
    let other = Heap::builder().bind(&other_pd).access(Access::ALL_REMOTE).build().unwrap();
    // (Exposed, so that the PD is the only thing wrong with a write through its key.)
    let foreign = other.alloc(4096).unwrap().expose().unwrap();
    let foreign_remote = foreign.remote();
    let err = a.write(&src, &foreign_remote, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");
    // Memory of another PD as the local side: refused before posting.
    let (c, _d) = Connection::pair(&pd, &Options::default()).unwrap();
    let other_buf = other.alloc(64).unwrap();
    assert!(matches!(c.write(&other_buf, &remote, 0), Err(Error::NotRegistered { .. })));
    // A device and a GID index that do not exist.
    let nodev = Options {
        device: DeviceChoice { name: Some("no-such-dev".into()), ..Default::default() },
        ..Options::default()
    };
    assert!(matches!(nodev.open_device(), Err(Error::NoSuchDevice { .. })));
    let nogid = Options { device: DeviceChoice { gid_index: Some(4000), ..Default::default() }, ..Options::default() };
    assert!(matches!(Connection::pair(&pd, &nogid), Err(Error::NoSuchIndex { what: "GID index", .. })));
    // Receives beyond the queue depth are refused, not lost.
    let opts = Options { qp: QpOptions { recv_depth: 4, ..Default::default() }, ..Options::default() };
    let (e, _f) = Connection::pair(&pd, &opts).unwrap();
    let mut posted = Vec::new();
    for _ in 0..e.options().qp.recv_depth {
        posted.push(e.post_recv(heap.alloc(64).unwrap()).unwrap());
    }
    let refused = e.post_recv(heap.alloc(64).unwrap()).map(|_| ()).unwrap_err();
    assert!(matches!(refused.error, Error::InvalidArgument(_)) && refused.buf.is_some());
    std::mem::forget(posted); // never filled: leak the buffers rather than wait for them
}

struct LinkUp;

impl Drop for LinkUp {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "set", "veth0", "up"]).status();
    }
}

fn port_active(dev: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/state")).is_ok_and(|s| s.contains("ACTIVE"))
}

/// The link goes down mid-stream: errors are typed and bounded; after it comes back a fresh
/// connection works.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_link_down_then_up() {
    if std::env::var("MRALLOC_IN_VM").is_err() {
        // scripts/test counts this marker as skipped, not passed.
        println!("mralloc-test: SKIPPED device_link_down_then_up: only inside the Soft-RoCE VM (it takes veth0 down)");
        return;
    }
    let (pd, heap) = setup();
    let mut opts = rights(Access::REMOTE_WRITE);
    opts.wait.op_timeout = Duration::from_secs(5);
    let (a, _b) = Connection::pair(&pd, &opts).unwrap();
    let mut src = heap.alloc(64 << 10).unwrap();
    src.copy_from_slice(&pattern(11, 64 << 10));
    let dst = heap.alloc(64 << 10).unwrap().expose().unwrap();
    a.write(&src, &dst.remote(), 0).unwrap();
    assert_bytes_eq(&dst.to_vec(), &src, "the write before the link went down");
    let guard = LinkUp;
    assert!(std::process::Command::new("ip").args(["link", "set", "veth0", "down"]).status().unwrap().success());
    let t = Instant::now();
    let mut err = None;
    for _ in 0..1000 {
        if let Err(e) = a.write(&src, &dst.remote(), 0) {
            err = Some(e);
            break;
        }
    }
    let took = t.elapsed();
    let err = err.expect("writes over a downed link must fail");
    println!("link down: the stream failed after {took:?} with: {err}");
    assert!(took < Duration::from_secs(15), "bounded");
    // The device's PORT_ERR event reaches the connection watcher before a write's own retries
    // run out (~0.5 s) or the operation timeout (5 s): the watcher's typed reason, nothing else.
    assert!(matches!(err, Error::Disconnected(Disconnect::PortDown { port: 1 })), "the watcher's reason: {err:?}");
    drop(guard); // link up
    let t = Instant::now();
    while !port_active(&device_name()) && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(port_active(&device_name()), "port ACTIVE again");
    // A fresh connection works (GIDs may take a moment to come back: retry briefly).
    let t = Instant::now();
    let (c, _d) = loop {
        match Connection::pair(&pd, &rights(Access::REMOTE_WRITE)) {
            Ok(p) => break p,
            Err(e) if t.elapsed() < Duration::from_secs(30) => {
                println!("  waiting for the link: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("no connection after the link came back: {e}"),
        }
    };
    let mut fresh = heap.alloc(64 << 10).unwrap();
    fresh.copy_from_slice(&pattern(12, 64 << 10));
    c.write(&fresh, &dst.remote(), 0).unwrap();
    assert_bytes_eq(&dst.to_vec(), &fresh, "the fresh connection's write arrived");
    println!("link up: port ACTIVE and a fresh connection moved 64 KiB after {:?}", t.elapsed());
}
