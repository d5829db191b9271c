//! The scoped heap's depot (host, no device): what a thread's full cache gives up, another
//! thread's empty cache takes whole.

use mralloc::heap::Heap;
use mralloc::Error;

/// A thread that only frees hands its older halves to the depot; a thread that only allocates
/// takes them back, exactly those objects, zeroed where asked.
#[test]
fn what_one_thread_frees_another_takes_whole() {
    let heap = Heap::builder().build().unwrap();
    // 2049 buffers of 64 B from this thread, freed on another: its magazine grows to its most
    // (2048) and, full at the last free, hands the older half (the first 1024 freed) on.
    let bufs: Vec<_> = (0..2049)
        .map(|i| {
            let mut b = heap.alloc(64).unwrap();
            b[..].fill(i as u8 | 1);
            b
        })
        .collect();
    let handed: Vec<usize> = bufs[..1024].iter().map(|b| b.as_ptr() as usize).collect();
    let h = &heap;
    std::thread::scope(|s| {
        s.spawn(move || {
            drop(bufs);
            let st = h.stats();
            assert_eq!(st.depot_bytes, 1024 * 64, "the older half went to the depot");
            assert_eq!(st.thread_cached_bytes, 1025 * 64, "the newer half and the last free stay");
        })
        .join()
        .unwrap();
    });
    // The freeing thread exited (its cache went back to jemalloc); the depot stays the heap's.
    let st = heap.stats();
    assert_eq!((st.thread_cached_bytes, st.depot_bytes), (0, 1024 * 64));
    // This thread's empty magazine takes the batch: its next 1024 allocations are those objects.
    let again: Vec<_> = (0..1024).map(|_| heap.alloc(64).unwrap()).collect();
    let got: Vec<usize> = again.iter().map(|b| b.as_ptr() as usize).collect();
    // A magazine is a stack: the last of the batch (the last freed) comes first.
    let newest_first: Vec<usize> = handed.iter().rev().copied().collect();
    let first_off = got.iter().zip(&newest_first).position(|(a, b)| a != b);
    assert_eq!(first_off, None, "the batch the other thread gave up, whole, no other object");
    assert!(again.iter().all(|b| b.iter().all(|&x| x == 0)), "alloc zeroes reused objects");
    let st = heap.stats();
    assert_eq!((st.thread_cached_bytes, st.depot_bytes), (0, 0), "taken whole");
    assert_eq!(st.live_bytes, 1024 * 64);
    drop(again);
    assert_eq!(heap.stats().live_bytes, 0);
}

/// The depot keeps at most the thread budget; past it, halves go back to jemalloc.
#[test]
fn the_depot_keeps_at_most_a_threads_budget() {
    const BUDGET: usize = 2 << 20;
    let heap = Heap::builder().thread_cache(BUDGET).build().unwrap();
    // 64 KiB objects: a magazine keeps at most 16, halves of 8 (512 KiB) go on: 4 fit.
    let bufs: Vec<_> = (0..200).map(|_| heap.alloc(64 << 10).unwrap()).collect();
    let before = heap.stats().jemalloc_allocated;
    let h = &heap;
    std::thread::scope(|s| {
        s.spawn(move || {
            drop(bufs);
            let st = h.stats();
            assert_eq!(st.depot_bytes, BUDGET as u64, "full, not over");
            assert!(st.thread_cached_bytes <= BUDGET as u64);
        })
        // Joined: the scope's own wait ends before the thread's caches go back.
        .join()
        .unwrap();
    });
    let st = heap.stats();
    if let (Some(b), Some(a)) = (before, st.jemalloc_allocated) {
        // jemalloc still counts what the caches keep; the rest went back to it.
        let kept = st.thread_cached_bytes + st.depot_bytes;
        assert_eq!(b - a, 200 * (64 << 10) - kept, "what did not fit went back to jemalloc: {a} vs {b}, {kept} kept");
    }
}

/// Memory the depot keeps never makes the heap's limit refuse an allocation: a refused chunk
/// empties it and the allocation is tried again.
#[test]
fn the_depots_objects_do_not_make_the_limit_fail_early() {
    let heap = Heap::builder().limit(16 << 20).thread_cache(64 << 20).build().unwrap();
    // 1 MiB objects (a magazine keeps one of them) until the limit refuses one.
    let mut held = Vec::new();
    loop {
        match heap.alloc(1 << 20) {
            Ok(b) => held.push(b),
            Err(Error::LimitExceeded { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(held.len() >= 8, "{}", held.len());
    drop(held);
    let st = heap.stats();
    assert_eq!(st.thread_cached_bytes, 1 << 20);
    assert!(st.depot_bytes >= 7 << 20, "the test needs the depot to hold much: {st:?}");
    // 896 KiB, a class none of the kept objects has: four of them need more than the one the
    // thread's magazine keeps, memory the depot holds.
    let more: Vec<_> = (0..4).map(|_| heap.alloc(896 << 10).expect("the depot's memory was given back")).collect();
    assert_eq!(heap.stats().depot_bytes, 0);
    drop(more);
}

/// Fills the depot with one 64 B batch (1024 objects) from a thread of its own, which exits.
fn one_batch_from_a_thread(heap: &Heap) {
    std::thread::scope(|s| {
        s.spawn(|| drop((0..2049).map(|_| heap.alloc(64).unwrap()).collect::<Vec<_>>())).join().unwrap();
    });
}

/// What the depot keeps returns to the heap when the last thread with a cache of the heap
/// exits (nobody would take it), and on `flush_thread_cache` from any thread, even one that
/// never used the heap.
#[test]
fn the_depot_empties_when_no_thread_uses_it() {
    let heap = Heap::builder().build().unwrap();
    one_batch_from_a_thread(&heap);
    assert_eq!(heap.stats().depot_bytes, 0, "the thread that filled it was the last with a cache");

    // With another thread's cache alive the batch stays, until a thread that has no cache of
    // the heap flushes it.
    let (made, done) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            drop(heap.alloc(64).unwrap());
            made.wait();
            done.wait();
        });
        made.wait();
        one_batch_from_a_thread(&heap);
        let kept = heap.stats().depot_bytes;
        heap.flush_thread_cache().unwrap();
        let flushed = heap.stats().depot_bytes;
        done.wait();
        t.join().unwrap();
        assert_eq!((kept, flushed), (1024 * 64, 0));
    });
}

/// A thread whose budget cannot pay for a batch leaves it in the depot for others (and asks
/// jemalloc), rather than throwing it away.
#[test]
fn a_thread_that_cannot_pay_leaves_the_batch() {
    const BUDGET: usize = 256 << 10;
    let heap = Heap::builder().thread_cache(BUDGET).build().unwrap();
    // This thread keeps ~240 KiB of 4 KiB buffers: no room for a 64 B batch (64 KiB + slots).
    let big: Vec<_> = (0..60).map(|_| heap.alloc(4096).unwrap()).collect();
    drop(big);
    one_batch_from_a_thread(&heap);
    assert_eq!(heap.stats().depot_bytes, 1024 * 64);
    let small: Vec<_> = (0..100).map(|_| heap.alloc(64).unwrap()).collect();
    let st = heap.stats();
    assert_eq!(st.depot_bytes, 1024 * 64, "the batch stays for another thread");
    assert!(st.thread_cached_bytes >= 60 * 4096, "and this thread's cache is as it was");
    drop(small);
}

/// A thread that frees a magazine's worth and takes its own batch back, round after round,
/// keeps its budget for other classes: adopting a batch into the magazine's own storage charges
/// nothing twice (a drift of the magazine's slots per round would use the 4 MiB budget up in a
/// few hundred rounds, after which no other class could cache anything).
#[test]
fn taking_batches_back_does_not_drift_the_budget() {
    let heap = Heap::builder().build().unwrap();
    for round in 0..400 {
        let bufs: Vec<_> = (0..2049).map(|_| heap.alloc(64).unwrap()).collect();
        assert_eq!(heap.stats().depot_bytes, 0, "round {round}: the batch was taken");
        drop(bufs);
        let st = heap.stats();
        assert_eq!((st.depot_bytes, st.thread_cached_bytes), (1024 * 64, 1025 * 64), "round {round}");
    }
    let big: Vec<_> = (0..256).map(|_| heap.alloc(4096).unwrap()).collect();
    drop(big);
    assert_eq!(heap.stats().thread_cached_bytes, 1025 * 64 + 256 * 4096);
}

/// A budget too small for a class's full cache still hands batches over: a magazine full and
/// unable to grow gives its older half to the depot, as one at its class's most does.
#[test]
fn a_small_budget_still_hands_batches_over() {
    const BUDGET: usize = 128 << 10;
    let heap = Heap::builder().thread_cache(BUDGET).build().unwrap();
    let bufs: Vec<_> = (0..100).map(|_| heap.alloc(4096).unwrap()).collect();
    let h = &heap;
    let depot = std::thread::scope(|s| s.spawn(move || drop(bufs)).join().map(|_| h.stats().depot_bytes).unwrap());
    assert_eq!(depot, BUDGET as u64, "halves of 16 x 4 KiB until the depot is full");
    // This thread's empty magazine takes a batch.
    let again = heap.alloc(4096).unwrap();
    assert!(heap.stats().depot_bytes < depot);
    drop(again);
}

/// A class the budget keeps at a tiny cache (its room taken by another class) sends its frees
/// to jemalloc: halves of one or two small buffers are not worth a batch (a lock and two
/// allocations each).
#[test]
fn a_tiny_cache_sends_its_frees_to_jemalloc() {
    const BUDGET: usize = 16 * (4096 + 8) + 16;
    let heap = Heap::builder().thread_cache(BUDGET).build().unwrap();
    let one = heap.alloc(8).unwrap();
    let pages: Vec<_> = (0..16).map(|_| heap.alloc(4096).unwrap()).collect();
    let small: Vec<_> = (0..1000).map(|_| heap.alloc(8).unwrap()).collect();
    let h = &heap;
    std::thread::scope(|s| {
        s.spawn(move || {
            drop(one);
            drop(pages);
            assert_eq!(h.stats().thread_cached_bytes, 8 + 16 * 4096, "the 8 B class keeps one");
            drop(small);
            let st = h.stats();
            assert_eq!((st.thread_cached_bytes, st.depot_bytes), (8 + 16 * 4096, 0));
        })
        .join()
        .unwrap();
    });
}
