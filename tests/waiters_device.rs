//! Many waiters on one connection, in every wait mode: threads sharing it, `Pending`s waited out
//! of order, found done by `is_done` or dropped (parked), a send queue small enough that posts
//! wait for room, receives waited newest first. Whoever reaps a completion, its own waiter gets
//! it; parked buffers are all released. Run by `scripts/test`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Poller, WaitMode};
use mralloc::verbs::{Access, Pd};

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    (pd, heap)
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_every_wait_mode_serves_mixed_waiters_sharing_a_connection() {
    let (pd, heap) = setup();
    let poller = Poller::spawn(None).unwrap();
    for (name, wait) in
        [("event", WaitMode::Event), ("poller", WaitMode::Poller(poller.clone())), ("busy", WaitMode::BusyPoll)]
    {
        let mut opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
        opts.wait.mode = wait;
        opts.wait.op_timeout = Duration::from_secs(5);
        opts.wait.recv_timeout = Some(Duration::from_secs(10));
        opts.qp.send_depth = 8; // 4 threads x up to 3 in flight: submit finds it full
        let (a, b) = Connection::pair(&pd, &opts).unwrap();
        const THREADS: usize = 4;
        const N: usize = 150;
        const LEN: usize = 64;
        const MSGS: usize = 400;
        let dst = heap.alloc(THREADS * N * LEN).unwrap().expose().unwrap();
        let remote = dst.remote();
        let base = heap.stats().live_bytes;
        let t0 = Instant::now();
        std::thread::scope(|s| {
            // Receiver on b: two receives posted, waited newest first (one handed back by the
            // reap, one left in the table), or found done by is_done.
            let (bref, heapr) = (&b, &heap);
            let rx = s.spawn(move || {
                let mut got = 0usize;
                while got < MSGS {
                    let p1 = bref.post_recv(heapr.alloc(LEN).unwrap()).unwrap();
                    let p2 = bref.post_recv(heapr.alloc(LEN).unwrap()).unwrap();
                    if got % 3 == 0 {
                        let st = Instant::now();
                        while !p2.is_done() {
                            assert!(st.elapsed() < Duration::from_secs(10), "{name}: recv is_done");
                            std::thread::yield_now();
                        }
                    }
                    let (m2, r2) = p2.wait().expect("second receive");
                    let (m1, r1) = p1.wait().expect("first receive");
                    assert_eq!((r1.len, r2.len), (LEN, LEN));
                    assert_eq!(m1[0] as usize, got % 251, "{name}: message {got} in order");
                    assert_eq!(m2[0] as usize, (got + 1) % 251, "{name}: message {} in order", got + 1);
                    got += 2;
                }
            });
            for t in 0..THREADS {
                let (a, heap, remote) = (&a, &heap, &remote);
                s.spawn(move || {
                    let mut src = heap.alloc(LEN).unwrap();
                    let mut back = heap.alloc(LEN).unwrap();
                    for i in 0..N {
                        let at = ((t * N + i) * LEN) as u64;
                        src.copy_from_slice(&pattern(at, LEN));
                        a.write(&src, remote, at).unwrap();
                        a.read(&mut back, remote, at).unwrap();
                        assert_bytes_eq(&back, &src, &format!("{name}: thread {t}, round {i}"));
                        // Three Pendings: the middle one dropped (parked), the last found done by
                        // is_done, the first waited last.
                        let filled = || {
                            let mut b = heap.alloc(LEN).unwrap();
                            b.copy_from_slice(&src);
                            b
                        };
                        let p1 = a.post_write(filled(), remote, at).unwrap();
                        let p2 = a.post_write(filled(), remote, at).unwrap();
                        let p3 = a.post_read(heap.alloc(LEN).unwrap(), remote, at).unwrap();
                        drop(p2);
                        if i % 2 == 0 {
                            let st = Instant::now();
                            while !p3.is_done() {
                                assert!(st.elapsed() < Duration::from_secs(5), "{name}: is_done");
                                std::hint::spin_loop();
                            }
                        }
                        let (r3, _) = p3.wait().expect("p3");
                        assert_bytes_eq(&r3, &src, &format!("{name}: p3 {t}/{i}"));
                        p1.wait().expect("p1");
                    }
                });
            }
            // Sender on a (the same send queue as the threads above).
            let mut m = heap.alloc(LEN).unwrap();
            for k in 0..MSGS {
                m.fill((k % 251) as u8);
                a.send(&m).unwrap();
            }
            rx.join().unwrap();
        });
        // One more reap on each side: whatever was parked is released by now.
        let x = heap.alloc(LEN).unwrap();
        a.write(&x, &remote, 0).unwrap();
        drop(x);
        let st = Instant::now();
        while heap.stats().live_bytes != base {
            assert!(
                st.elapsed() < Duration::from_secs(5),
                "{name}: parked buffers released: {} != {base}",
                heap.stats().live_bytes
            );
            let y = heap.alloc(8).unwrap();
            a.write(&y, &remote, 0).unwrap();
        }
        assert_eq!(a.stats().sends_in_flight, 0, "{name}");
        println!("{name}: ok in {:?} ({:?})", t0.elapsed(), a.stats());
    }
}
