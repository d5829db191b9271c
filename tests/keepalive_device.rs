//! Keepalive probes on one device: they go out while a connection is idle without failing it or
//! showing in its counters; a peer that did not enable keepalive refuses them, which fails the
//! prober with a typed error. (A peer whose path is cut is found in `topology_hosts`, across
//! two linked VMs: one VM cannot black-hole its own Soft-RoCE traffic.)

mod common;

use std::time::{Duration, Instant};

use common::{assert_bytes_eq, open, pattern};
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, Options};
use mralloc::verbs::{Pd, WcStatus};
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
    let (pd, heap) = setup();
    let device = pd.context().name().to_string();
    let every = Duration::from_millis(200);
    let idle = Duration::from_secs(3);
    let (a, b) = Connection::pair(&pd, &keepalive(every)).unwrap();
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
    // Each probe is a request and its ACK, from both ends: ~4 packets per interval. The
    // application sent one message (two packets with its ACK).
    let intervals = start.elapsed().as_millis() as u64 / every.as_millis() as u64;
    println!("keepalive every {every:?}: {sent} packets in {:?} of silence ({intervals} intervals)", start.elapsed());
    assert!(sent >= intervals, "only {sent} packets went out in {intervals} keepalive intervals");
    // Probes are no application requests.
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!((sa.send_requests, sa.recv_requests, sb.send_requests, sb.recv_requests), (0, 1, 1, 0));
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
    let opts = Options { recv_timeout: Some(Duration::from_secs(20)), ..keepalive(every) };
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
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_keepalive_of_zero_is_refused() {
    let (pd, _heap) = setup();
    let r = Connection::pair(&pd, &keepalive(Duration::ZERO));
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{:?}", r.err());
}
