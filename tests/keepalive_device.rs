//! Keepalive probes on one device: they go out from both ends while a connection is idle
//! without failing it or showing in its counters; a send queue held up by a peer that posts no
//! receive is not taken for a dead peer; a peer that did not enable keepalive refuses them,
//! which fails the prober with a typed error; a QP the device moved to the error state without
//! a completion is found by the next probe. (A peer whose path is cut is found in
//! `topology_hosts`, across two linked VMs: one VM cannot black-hole its own Soft-RoCE
//! traffic.)

mod common;

use std::time::{Duration, Instant};

use common::{assert_bytes_eq, open, pattern};
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, Options};
use mralloc::verbs::{Access, Pd, WcStatus};
use mralloc::{Disconnect, Error};

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).build().unwrap();
    (pd, heap)
}

/// Packets the device has sent on port 1 (rxe's `sent_pkts` counter).
fn sent_packets(device: &str) -> u64 {
    let p = format!("/sys/class/infiniband/{device}/ports/1/hw_counters/sent_pkts");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}")).trim().parse().unwrap()
}

fn keepalive(every: Duration) -> Options {
    Options { keepalive: Some(every), ..Options::default() }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_keepalive_probes_an_idle_connection_without_failing_it() {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().access(Access::ALL_REMOTE).bind(&pd).build().unwrap();
    let device = pd.context().name().to_string();
    let every = Duration::from_millis(200);
    let idle = Duration::from_secs(3);
    let (a, b) = Connection::pair(&pd, &keepalive(every)).unwrap();
    // b abandons a WRITE (its Pending dropped): its completion waits in the CQ with nobody to
    // reap it — the send queue must not look busy for ever, keeping b's probes in.
    let target = heap.alloc(4096).unwrap().expose().unwrap();
    drop(b.post_write(heap.alloc(4096).unwrap(), &target.remote(), 0).map_err(|r| r.error).unwrap());
    let before = sent_packets(&device);
    let start = Instant::now();
    // A receive waits through the probes; the message after the silence arrives intact.
    let got = std::thread::scope(|s| {
        let r = s.spawn(|| {
            let mut inbox = heap.alloc(4096).unwrap();
            let n = a.recv(&mut inbox).map(|g| g.len);
            (n, inbox.to_vec())
        });
        std::thread::sleep(idle);
        assert!(a.error().is_none() && b.error().is_none(), "a probed idle pair failed");
        let mut msg = heap.alloc(4096).unwrap();
        msg.copy_from_slice(&pattern(21, 4096));
        b.send(&msg).unwrap();
        r.join().unwrap()
    });
    let sent = sent_packets(&device) - before;
    assert_eq!(got.0.unwrap(), 4096);
    assert_bytes_eq(&got.1, &pattern(21, 4096), "the message after the probed silence");
    // Each probe is a request and its ACK, from both ends: ~4 packets per interval (one end
    // alone would send 2). The application sent one message (two packets with its ACK).
    let intervals = start.elapsed().as_millis() as u64 / every.as_millis() as u64;
    println!("keepalive every {every:?}: {sent} packets in {:?} of silence ({intervals} intervals)", start.elapsed());
    assert!(sent >= 3 * intervals, "only {sent} packets went out in {intervals} keepalive intervals: both ends probe?");
    // Probes are no application requests (b's are the WRITE and the SEND).
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!((sa.send_requests, sa.recv_requests, sb.send_requests, sb.recv_requests), (0, 1, 2, 0));
    assert_eq!((sa.errors, sb.errors), (0, 0));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_keepalive_refused_by_a_peer_without_it_fails_the_prober() {
    let (pd, heap) = setup();
    let every = Duration::from_millis(300);
    let listener = Listener::bind("127.0.0.1:0", &pd, Options::default()).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || listener.accept().unwrap());
    // Bounded: were the probes broken, the receive would fail with a timeout, not hang.
    let mut opts = keepalive(every);
    opts.wait.recv_timeout = Some(Duration::from_secs(20));
    let conn = Connection::connect(addr, &pd, opts).unwrap();
    let peer = server.join().unwrap();
    let start = Instant::now();
    let mut inbox = heap.alloc(64).unwrap();
    let r = conn.recv(&mut inbox).map(|g| g.len);
    let after = start.elapsed();
    println!("probe refused: {r:?} after {after:?}; the peer: {:?}", peer.error());
    assert!(
        matches!(r, Err(Error::Disconnected(Disconnect::KeepaliveFailed { status: WcStatus::RemInvReqErr }))),
        "{r:?}"
    );
    assert!(after < every + Duration::from_secs(3), "found after {after:?}");
    assert!(matches!(conn.error(), Some(Error::Disconnected(Disconnect::KeepaliveFailed { .. }))));
    // The refused probe and the receive's flush.
    assert_eq!(conn.stats().errors, 2, "{:?}", conn.stats());
    // rxe moved the refusing peer's QP to the error state without a completion on its side: its
    // next request is flushed, and reports that.
    let msg = heap.alloc(64).unwrap();
    let e = peer.send(&msg).unwrap_err();
    println!("the refusing peer's next send: {e}");
    assert_eq!(e.wc_status(), Some(WcStatus::WrFlushErr), "{e}");
}

/// A SEND the peer has no receive for waits (RNR retries, for ever by default) with the peer
/// alive: a probe queued behind it would be held up as long, and its deadline would take the
/// peer for dead. Probes wait for an empty send queue instead.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_keepalive_waits_for_a_send_queue_held_up_by_the_peer() {
    let (pd, heap) = setup();
    let every = Duration::from_millis(50);
    let opts = keepalive(every);
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let mut msg = heap.alloc(4096).unwrap();
    msg.copy_from_slice(&pattern(5, 4096));
    let pending = a.post_send(msg).unwrap();
    // Past the probe deadline (the default retry time, 0.54 s, over two intervals) twice over.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!pending.is_done(), "the SEND had no receive to land in");
    assert!(a.error().is_none() && b.error().is_none(), "a: {:?}, b: {:?}", a.error(), b.error());
    let mut inbox = heap.alloc(4096).unwrap();
    assert_eq!(b.recv(&mut inbox).unwrap().len, 4096);
    assert_bytes_eq(&inbox, &pattern(5, 4096), "the held-up message");
    let (sent, _) = pending.wait().map_err(|r| r.error).unwrap();
    assert_eq!(sent.len(), 4096);
    // Probes resume on the now empty queue, and still fail nothing.
    std::thread::sleep(every * 6);
    assert!(a.error().is_none() && b.error().is_none(), "a: {:?}, b: {:?}", a.error(), b.error());
}

/// rxe moves the target of a request it refuses (here a WRITE under a key that does not exist:
/// a READ its QP does not allow is refused before posting now) to the error state with no
/// completion on that side. With nothing outstanding there, only the next probe — flushed —
/// tells: the connection fails with `KeepaliveFailed { WrFlushErr }` instead of looking healthy
/// for ever.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_keepalive_finds_a_qp_that_went_to_the_error_state_silently() {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().access(Access::ALL_REMOTE).bind(&pd).build().unwrap();
    let every = Duration::from_millis(100);
    let (a, b) = Connection::pair(&pd, &keepalive(every)).unwrap();
    let target = heap.alloc(64).unwrap().expose().unwrap();
    let forged = mralloc::RemoteBuf { rkey: target.remote().rkey ^ 0x00ff_ff00, ..target.remote() };
    let e = a.write(&heap.alloc(64).unwrap(), &forged, 0).unwrap_err();
    assert_eq!(e.wc_status(), Some(WcStatus::RemAccessErr), "the WRITE under a forged key: {e}");
    let start = Instant::now();
    while b.error().is_none() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("b, after its QP went to the error state silently: {:?} after {:?}", b.error(), start.elapsed());
    assert!(
        matches!(b.error(), Some(Error::Disconnected(Disconnect::KeepaliveFailed { status: WcStatus::WrFlushErr }))),
        "{:?}",
        b.error()
    );
    assert!(start.elapsed() < every * 2 + Duration::from_secs(1), "found after {:?}", start.elapsed());
    assert_eq!(b.stats().errors, 0, "a probe's flush is not the application's error");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_keepalive_of_zero_or_over_a_day_is_refused() {
    let (pd, _heap) = setup();
    for every in [Duration::ZERO, Duration::from_secs(86_401), Duration::MAX] {
        let r = Connection::pair(&pd, &keepalive(every));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{every:?}: {:?}", r.err());
    }
    assert!(Connection::pair(&pd, &keepalive(Duration::from_secs(86_400))).is_ok());
}
