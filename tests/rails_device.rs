//! Rail groups on one device (Soft-RoCE in the VM): two loopback connection pairs as two rails
//! (`Rails::new`), and the one-call setup over TCP. Two devices and a cut link:
//! `tests/topology_hosts.rs`. Run by `scripts/test`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use common::rails::{groups, inbox, setup, ExtraDevice, EXTRA, RW};
use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, IoBuf, RailOptions, Rails, RailsListener, Secret, SetupOptions, Slice};
use mralloc::verbs::{Access, Pd};
use mralloc::{Buffer, Error, RemoteDesc};

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_striped_writes_and_reads_are_byte_exact_and_use_both_rails() {
    let (pd, heap, opts) = setup(64 << 10, 512 << 10);
    let (ours, _theirs) = groups(&pd, &opts, 2);
    for (i, &n) in [1usize, 4095, (64 << 10) + 1, 1 << 20, (8 << 20) + 3, 64 << 20].iter().enumerate() {
        let off = 5 + i as u64;
        let (target, desc) = inbox(&heap, n + 16);
        let want = pattern(i as u64, n);
        let mut src = heap.alloc(n).unwrap();
        src.copy_from_slice(&want);
        let done = ours.post_write(src, &desc, off).map_err(|r| r.error).unwrap().wait();
        assert!(done.is_ok(), "{n}: {done:?}");
        let moved: Vec<u64> = done.rails().iter().map(|r| r.bytes).collect();
        assert_eq!(moved.iter().sum::<u64>(), n as u64, "{n}: every byte once: {moved:?}");
        if n > 2 * opts.slice {
            assert!(moved.iter().all(|&b| b > 0), "{n} bytes over both rails: {moved:?}");
        }
        assert_bytes_eq(&target.to_vec()[off as usize..off as usize + n], &want, &format!("striped write {n}"));
        assert!(target.to_vec()[..off as usize].iter().all(|&b| b == 0), "{n}: nothing before the range");

        let back = ours.post_read(heap.alloc_uninit(n).unwrap(), &desc, off).map_err(|r| r.error).unwrap().wait();
        let (back, _) = back.into_one().unwrap();
        assert_eq!(back.init_len(), n, "a READ initialises all of its target");
        let back = back.into_init();
        assert_bytes_eq(&back, &want, &format!("striped read {n}"));
        println!("{n} bytes: written and read back, bytes per rail {moved:?}");
    }
    assert!(ours.info().iter().all(|r| r.alive && r.outstanding == 0), "{:?}", ours.info());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_list_of_1000_pages_lands_at_scattered_offsets_with_errors_per_piece() {
    const PAGE: usize = 4096;
    let (pd, heap, opts) = setup(16 << 10, 256 << 10);
    let (ours, _theirs) = groups(&pd, &opts, 2);
    let (target, desc) = inbox(&heap, 2000 * PAGE);
    // Page i goes to slot perm[i] of 2000 (every other slot stays empty), in a shuffled order.
    let mut rng = Rng(7);
    let mut slots: Vec<usize> = (0..2000).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let whole = |b: Buffer| b.into_slice(..).map_err(|r| r.error).unwrap();
    let mut pieces: Vec<(Slice<Buffer>, RemoteDesc)> = (0..1000)
        .map(|i| {
            let mut b = heap.alloc(PAGE).unwrap();
            b.copy_from_slice(&pattern(1000 + i as u64, PAGE));
            (whole(b), desc.slice((slots[i] * PAGE) as u64..((slots[i] + 1) * PAGE) as u64).unwrap())
        })
        .collect();
    // Piece 1000: longer than its remote range; piece 1001: no bytes. Each fails alone.
    pieces.push((whole(heap.alloc(PAGE).unwrap()), desc.slice(0..100).unwrap()));
    let empty = heap.alloc(8).unwrap().into_slice(0..0).map_err(|r| r.error).unwrap();
    pieces.push((empty, desc.slice(0..100).unwrap()));
    let done = ours.post_write_list(pieces).wait();
    let errors: Vec<(usize, String)> = done.piece_errors().map(|(i, e)| (i, format!("{e:?}"))).collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].0 == 1000 && errors[0].1.contains("OutOfBounds"), "{errors:?}");
    assert!(errors[1].0 == 1001 && errors[1].1.contains("InvalidArgument"), "{errors:?}");
    assert!(done.rails().iter().all(|r| r.bytes > 0 && r.failure.is_none()), "{:?}", done.rails());
    assert_eq!(done.rails().iter().map(|r| r.bytes).sum::<u64>(), (1000 * PAGE) as u64);
    let (bufs, errs, _) = done.into_parts();
    assert_eq!((bufs.unwrap().len(), errs.len()), (1002, 1002), "every buffer back");
    let got = target.to_vec();
    for (i, slot) in slots.iter().enumerate().take(1000) {
        let at = slot * PAGE;
        assert_bytes_eq(&got[at..at + PAGE], &pattern(1000 + i as u64, PAGE), &format!("page {i} at slot {slot}"));
    }
    // Read them back as one list into fresh pages.
    let reads: Vec<(Buffer, RemoteDesc)> = (0..1000)
        .map(|i| {
            (heap.alloc(PAGE).unwrap(), desc.slice((slots[i] * PAGE) as u64..((slots[i] + 1) * PAGE) as u64).unwrap())
        })
        .collect();
    let (pages, _) = ours.post_read_list(reads).wait().into_result().unwrap();
    for (i, p) in pages.iter().enumerate() {
        assert_bytes_eq(p, &pattern(1000 + i as u64, PAGE), &format!("page {i} read back"));
    }
}

/// A 32 MiB write loses rail 1 midway: `how` ends it (our end closed, or the peer's end
/// closed: then our slices on it fail by retries exhausted, and are posted on rail 0).
fn lose_rail_1_midway(how: &str) {
    const N: usize = 32 << 20;
    let (pd, heap, mut opts) = setup(64 << 10, 1 << 20);
    if how == "silent" {
        // rxe retries for ever with the default retry count of 7: nothing but the transfer's
        // own deadline (the connection's op_timeout) finds the dead rail.
        opts.conn.wait.op_timeout = std::time::Duration::from_secs(2);
    } else {
        opts.conn.qp.retry_count = 6; // a peer gone is found in ~0.5 s
    }
    let (mut ours, mut theirs) = groups(&pd, &opts, 2);
    let (target, desc) = inbox(&heap, N);
    let want = pattern(99, N);
    let mut src = heap.alloc(N).unwrap();
    src.copy_from_slice(&want);
    let mut t = ours.post_write(src, &desc, 0).map_err(|r| r.error).unwrap();
    // Let rail 1 carry some, then end it under the transfer.
    wait_for("rail 1 to move bytes", WAIT, || {
        t.progress();
        ours.info()[1].bytes > 0
    });
    match how {
        "ours" => ours.rail(1).close().unwrap(),
        _ => theirs.rail(1).close().unwrap(),
    }
    let lost = std::time::Instant::now();
    let done = t.wait();
    println!("{how}: rail 1 lost; done {:?} later: {:?}", lost.elapsed(), done.rails());
    assert!(done.is_ok(), "{done:?}");
    let r1 = &done.rails()[1];
    match how {
        "ours" => assert!(matches!(r1.failure, Some(Error::Closed)), "the report names rail 1's failure: {r1:?}"),
        "silent" => {
            let timed_out = Some(mralloc::verbs::WcStatus::RespTimeoutErr);
            assert!(
                matches!(r1.failure, Some(Error::Operation { status, .. }) if Some(status) == timed_out),
                "the report names rail 1's deadline: {r1:?}"
            );
            assert!(r1.reposted > 0, "the stalled slices were posted again: {r1:?}");
            assert!(lost.elapsed() < std::time::Duration::from_secs(20), "a silent rail held the transfer up");
        }
        _ => {
            assert!(matches!(r1.failure, Some(Error::Operation { .. })), "the report names rail 1's failure: {r1:?}");
            assert!(
                r1.reposted > 0,
                "slices posted on the dead rail before its failure showed were posted again: {r1:?}"
            );
        }
    }
    assert_eq!(done.rails().iter().map(|r| r.bytes).sum::<u64>(), N as u64);
    assert_bytes_eq(&target.to_vec(), &want, "32 MiB over two rails, one lost midway");
    let info = ours.info();
    assert!(!info[1].alive && info[0].alive && info.iter().all(|r| r.outstanding == 0), "{info:?}");
    // A new connection in rail 1's place: the next transfer uses both rails again.
    let (x, y) = Connection::pair(&pd, &opts.conn).unwrap();
    assert!(ours.restore(2, Connection::pair(&pd, &opts.conn).unwrap().0).is_err(), "no rail 2");
    ours.restore(1, x).unwrap();
    theirs.restore(1, y).unwrap();
    let mut src = heap.alloc(8 << 20).unwrap();
    src.copy_from_slice(&pattern(100, 8 << 20));
    let done = ours.post_write(src, &desc, 0).map_err(|r| r.error).unwrap().wait();
    assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0 && r.failure.is_none()), "{done:?}");
    assert_bytes_eq(&target.to_vec()[..8 << 20], &pattern(100, 8 << 20), "after rail 1 was restored");
    // A piece only dead rails could reach fails with RailsDown.
    ours.rail(1).close().unwrap();
    ours.rail(0).close().unwrap();
    let r = ours.post_write(heap.alloc(10).unwrap(), &desc, 0).map(|_| ()).map_err(|r| r.error);
    assert!(matches!(r, Err(Error::RailsDown { ref failures }) if failures.len() == 2), "{r:?}");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_rail_closed_mid_transfer_leaves_the_rest_to_the_other() {
    lose_rail_1_midway("ours");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_rail_whose_peer_went_away_has_its_slices_posted_on_the_other() {
    lose_rail_1_midway("theirs");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_rail_that_goes_silent_is_failed_at_its_deadline_and_its_slices_posted_on_the_other() {
    lose_rail_1_midway("silent");
}

/// A buffer that records, when dropped, how many bytes the group still had in flight.
struct Tracked {
    buf: Buffer,
    outstanding: Box<dyn Fn() -> u64 + Send>,
    dropped: Arc<AtomicBool>,
    in_flight_then: Arc<AtomicU64>,
}

fn in_flight(info: Vec<mralloc::transfer::RailInfo>) -> u64 {
    info.iter().map(|i| i.outstanding).sum()
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let left = (self.outstanding)();
        self.in_flight_then.store(left, Ordering::SeqCst);
        self.dropped.store(true, Ordering::SeqCst);
    }
}

// SAFETY: delegates to a heap Buffer, which the wrapper owns (and frees only in its own drop).
unsafe impl IoBuf for Tracked {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.buf.len()
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_dropped_transfer_frees_its_buffer_only_after_every_slice() {
    let (pd, heap, opts) = setup(64 << 10, 1 << 20);
    let (ours, _theirs) = groups(&pd, &opts, 2);
    let ours = Arc::new(ours);
    let (target, desc) = inbox(&heap, 16 << 20);
    let dropped = Arc::new(AtomicBool::new(false));
    let in_flight_then = Arc::new(AtomicU64::new(u64::MAX));
    let buf = Tracked {
        buf: heap.alloc(16 << 20).unwrap(),
        outstanding: {
            let w: Weak<Rails> = Arc::downgrade(&ours);
            Box::new(move || w.upgrade().map_or(0, |r| in_flight(r.info())))
        },
        dropped: dropped.clone(),
        in_flight_then: in_flight_then.clone(),
    };
    let t = ours.post_write(buf, &desc, 0).map_err(|r| r.error).unwrap();
    let posted = ours.info().iter().map(|r| r.outstanding).sum::<u64>();
    assert!(posted > 0, "slices in flight when dropped");
    drop(t); // returns at once; the buffer waits for the slices
    wait_for("the parked buffer's release", WAIT, || {
        (0..2).for_each(|i| drop(ours.rail(i).progress()));
        dropped.load(Ordering::SeqCst)
    });
    assert_eq!(in_flight_then.load(Ordering::SeqCst), 0, "freed while slices were in flight ({posted} bytes posted)");
    assert!(ours.info().iter().all(|r| r.outstanding == 0 && r.alive), "{:?}", ours.info());
    // The group goes on.
    let done = ours.post_write(heap.alloc(1 << 20).unwrap(), &desc, 0).map_err(|r| r.error).unwrap().wait();
    assert!(done.is_ok(), "{done:?}");
    drop(target);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_rails_connect_in_one_call_with_the_secret_honoured() {
    let (pd, heap, mut opts) = setup(64 << 10, 1 << 20);
    opts.conn.setup =
        SetupOptions { secret: Some(Secret::new(b"rails in one call").unwrap()), ..SetupOptions::default() };
    let pds = [pd.clone(), pd.clone()];
    let listener = RailsListener::bind("127.0.0.1:0", &pds, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let (x, desc) = inbox(&heap, 4 << 20);
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let rails = listener.accept_with(&desc.to_vec()).unwrap();
            assert_eq!(rails.peer_blob(), b"hello from the client");
            // Wait for the client's word that it is done, on the message rail.
            let mut m = heap.alloc(8).unwrap();
            let got = rails.recv(&mut m).unwrap();
            assert_eq!(&m[..got.len], b"done");
            rails
        });
        // Without the secret: refused.
        let plain = RailOptions { conn: rights(RW), ..opts.clone() };
        let r = Rails::connect(addr, &pds, plain);
        assert!(matches!(r, Err(Error::Authentication(_))), "{r:?}");
        let rails = connect_retrying(|| Rails::connect_with(addr, &pds, opts.clone(), b"hello from the client"));
        assert_eq!(rails.len(), 2);
        let theirs = RemoteDesc::from_bytes(rails.peer_blob()).unwrap();
        let mut src = heap.alloc(4 << 20).unwrap();
        src.copy_from_slice(&pattern(5, 4 << 20));
        let done = rails.post_write(src, &theirs, 0).map_err(|r| r.error).unwrap().wait();
        assert!(done.rails().iter().all(|r| r.bytes > 0), "{:?}", done.rails());
        let mut m = heap.alloc(4).unwrap();
        m.copy_from_slice(b"done");
        rails.send(&m).unwrap();
        let _server_side = server.join().unwrap();
        assert_bytes_eq(&x.to_vec(), &pattern(5, 4 << 20), "written over rails set up in one call");
    });
}

#[cfg(feature = "tokio")]
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_async_rails_stripe_set_up_in_one_call_and_a_cancelled_transfer_frees_nothing_early() {
    use mralloc::transfer::{AsyncConnection, AsyncRails, AsyncRailsListener};
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let (pd, heap, opts) = setup(64 << 10, 1 << 20);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            let (x, y) = AsyncConnection::pair(&pd, &opts.conn).unwrap();
            a.push(x);
            b.push(y);
        }
        let ours = Arc::new(AsyncRails::new(a, opts.clone()).unwrap());
        let _theirs = AsyncRails::new(b, opts.clone()).unwrap();
        let n = (8 << 20) + 3;
        let (target, desc) = inbox(&heap, n);
        let mut src = heap.alloc(n).unwrap();
        src.copy_from_slice(&pattern(21, n));
        let done = ours.write(src, &desc, 0).await;
        assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0), "{done:?}");
        assert_bytes_eq(&target.to_vec(), &pattern(21, n), "async striped write");
        let (mut back, _) = ours.read(heap.alloc_uninit(n).unwrap(), &desc, 0).await.into_result().unwrap();
        assert_bytes_eq(&back.pop().unwrap().into_init(), &pattern(21, n), "async striped read");
        // A refusal resolves at once with the buffer back.
        let refused = ours.write(heap.alloc(16).unwrap(), &desc, n as u64).await;
        let (bufs, errs, _) = refused.into_parts();
        assert!(bufs.is_some_and(|b| b.len() == 1) && matches!(errs[0], Some(Error::OutOfBounds { .. })), "{errs:?}");

        // Cancelled after its first poll: the buffer waits for every slice.
        let dropped = Arc::new(AtomicBool::new(false));
        let in_flight_then = Arc::new(AtomicU64::new(u64::MAX));
        let w = Arc::downgrade(&ours);
        let buf = Tracked {
            buf: heap.alloc(8 << 20).unwrap(),
            outstanding: Box::new(move || w.upgrade().map_or(0, |r| in_flight(r.info()))),
            dropped: dropped.clone(),
            in_flight_then: in_flight_then.clone(),
        };
        let r = tokio::time::timeout(std::time::Duration::ZERO, ours.write(buf, &desc, 0)).await;
        assert!(r.is_err(), "8 MiB in 1 MiB windows cannot be done at the first poll");
        let t = std::time::Instant::now();
        while !dropped.load(Ordering::SeqCst) {
            assert!(t.elapsed() < WAIT, "the cancelled transfer's buffer was never released");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(in_flight_then.load(Ordering::SeqCst), 0, "freed while slices were in flight");
        assert!(ours.info().iter().all(|r| r.alive && r.outstanding == 0), "{:?}", ours.info());

        // Set up in one call, async, with an application blob each way.
        let pds = [pd.clone(), pd.clone()];
        let listener = AsyncRailsListener::bind("127.0.0.1:0", &pds, opts.clone()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let blob = desc.to_vec();
        let word = heap.alloc(8).unwrap();
        let server = tokio::spawn(async move {
            let r = listener.accept_with(&blob).await.unwrap();
            assert_eq!(r.peer_blob(), b"async hello");
            let (m, got) = r.messages().unwrap().recv(word).await.unwrap();
            assert_eq!(&m[..got.len], b"done");
        });
        let client = AsyncRails::connect_with(addr, &pds, opts.clone(), b"async hello").await.unwrap();
        let theirs = RemoteDesc::from_bytes(client.peer_blob()).unwrap();
        let mut src = heap.alloc(4 << 20).unwrap();
        src.copy_from_slice(&pattern(22, 4 << 20));
        let done = client.write(src, &theirs, 0).await;
        assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0), "{done:?}");
        let mut m = heap.alloc(4).unwrap();
        m.copy_from_slice(b"done");
        client.messages().unwrap().send(m).await.unwrap();
        server.await.unwrap();
        assert_bytes_eq(
            &target.to_vec()[..4 << 20],
            &pattern(22, 4 << 20),
            "written over async rails set up in one call",
        );
    });
}

/// Two devices on two NUMA nodes (scripts/test's device run boots a 2-node VM; the devices'
/// nodes are named through `MRALLOC_NUMA_NODE`, as on a machine whose sysfs does not tell): a
/// buffer on node 0 goes over the rail of the device on node 0 only, one on node 1 over the
/// other; with `prefer_local` off both rails carry each; with the local rail dead the other
/// takes it all.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_rails_prefer_the_device_on_the_buffers_numa_node() {
    use mralloc::heap::NumaPolicy;
    use mralloc::verbs::Context;
    assert!(mralloc::heap::online_nodes().len() >= 2, "run in a 2-node VM (scripts/softroce --numa 2)");
    let _extra = ExtraDevice::add();
    std::env::set_var(mralloc::verbs::NUMA_OVERRIDE, format!("{}:0,{EXTRA}:1", device_name()));
    let pds = [Pd::new(&open()).unwrap(), Pd::new(&Context::open(EXTRA).unwrap()).unwrap()];
    let heap_on = |node| {
        Heap::builder()
            .bind(&pds[0])
            .bind(&pds[1])
            .numa(NumaPolicy::Node(node))
            .access(Access::ALL_REMOTE)
            .build()
            .unwrap()
    };
    let heaps = [heap_on(0), heap_on(1)];
    let group = |prefer_local| {
        let opts = RailOptions { conn: rights(RW), slice: 64 << 10, prefer_local, ..RailOptions::default() };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for pd in &pds {
            let (x, y) = Connection::pair(pd, &opts.conn).unwrap();
            a.push(x);
            b.push(y);
        }
        (Rails::new(a, opts.clone()).unwrap(), Rails::new(b, opts).unwrap())
    };
    let (ours, _theirs) = group(true);
    let nodes: Vec<Option<u32>> = ours.info().iter().map(|r| r.numa_node).collect();
    assert_eq!(nodes, [Some(0), Some(1)], "{:?}", ours.info());
    let (target, desc) = inbox(&heaps[0], 4 << 20);
    assert_eq!(desc.keys().len(), 2, "a key per device");
    let moved = |rails: &Rails, node: usize, seed: u64| {
        let mut src = heaps[node].alloc(4 << 20).unwrap();
        src.copy_from_slice(&pattern(seed, 4 << 20));
        let done = rails.post_write(src, &desc, 0).map_err(|r| r.error).unwrap().wait();
        assert!(done.is_ok(), "{done:?}");
        assert_bytes_eq(&target.to_vec(), &pattern(seed, 4 << 20), "written");
        done.rails().iter().map(|r| r.bytes).collect::<Vec<u64>>()
    };
    assert_eq!(moved(&ours, 0, 1), [4 << 20, 0], "a buffer on node 0 over the node-0 device only");
    assert_eq!(moved(&ours, 1, 2), [0, 4 << 20], "a buffer on node 1 over the node-1 device only");
    let (spread, _spread_theirs) = group(false);
    assert!(moved(&spread, 0, 3).iter().all(|&b| b > 0), "prefer_local off: both rails");
    ours.rail(0).close().unwrap();
    assert_eq!(moved(&ours, 0, 4), [0, 4 << 20], "the node-0 device dead: the other takes it");
    std::env::remove_var(mralloc::verbs::NUMA_OVERRIDE);
}
