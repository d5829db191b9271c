//! The registered heap without a device: an unbound heap runs the same hooks, chunk table and
//! page map (only `ibv_reg_mr` is skipped), so its invariants are checked natively here.

mod common;

use allocator_api2::alloc::Allocator;
use common::model::{op, run_model, SendLive};
use mralloc::heap::{chunk_of, Heap};
use mralloc::Error;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn heap_matches_model_from_two_threads(a in proptest::collection::vec(op(16 << 20), 1..60), b in proptest::collection::vec(op(16 << 20), 1..60)) {
        let heap = Heap::builder().build().unwrap();
        let (la, lb) = std::thread::scope(|s| {
            let ta = s.spawn(|| SendLive(run_model(&heap, &a, 1)));
            let tb = s.spawn(|| SendLive(run_model(&heap, &b, 2)));
            (ta.join().unwrap().0, tb.join().unwrap().0)
        });
        let model_live: usize = la.iter().chain(&lb).map(|l| l.layout.size()).sum();
        prop_assert_eq!(heap.stats().live_bytes, model_live as u64);
        // Cross-thread overlap check, then free everything (from this thread).
        let mut all: Vec<(usize, usize)> = la.iter().chain(&lb).map(|l| (l.ptr.as_ptr() as usize, l.layout.size())).collect();
        all.sort();
        for w in all.windows(2) {
            prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap between threads");
        }
        for l in la.into_iter().chain(lb) {
            // SAFETY: allocated from &heap with l.layout.
            unsafe { heap.deallocate(l.ptr, l.layout) };
        }
        prop_assert_eq!(heap.stats().live_bytes, 0);
    }
}

/// (size, align) pairs with alignments from 1 to 2 MiB, sizes below, at and above them.
fn size_align() -> impl Strategy<Value = (usize, usize)> {
    (0u32..=21, 1usize..=4, prop_oneof![Just(0usize), 1usize..64, 1usize..100_000]).prop_map(|(lg, mul, extra)| {
        let align = 1usize << lg;
        // Size below the alignment about a third of the time (8 bytes aligned to 16, ...).
        let size = if extra == 0 { (align / 2).max(1) } else { align * mul / 4 + extra };
        (size.max(1), align)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The Allocator contract: every block is aligned as asked, whatever the size (size below
    /// alignment included: `Layout { size: 8, align: 16 }` used to get jemalloc's 8-byte class).
    #[test]
    fn every_layout_comes_back_aligned((size, align) in size_align()) {
        let heap = shared_heap();
        let layout = std::alloc::Layout::from_size_align(size, align).unwrap();
        let blocks: Vec<_> = (0..16).map(|_| heap.allocate(layout).unwrap()).collect();
        for b in &blocks {
            prop_assert_eq!(b.cast::<u8>().as_ptr() as usize % align, 0, "{:?}", layout);
            prop_assert!(b.len() >= size);
        }
        for b in blocks {
            // SAFETY: allocated above with `layout`.
            unsafe { heap.deallocate(b.cast(), layout) };
        }
        let buf = heap.alloc_layout(layout).unwrap();
        prop_assert_eq!(buf.addr() as usize % align, 0, "Heap::alloc_layout {:?}", layout);
    }
}

/// One heap for the alignment proptest's many cases.
fn shared_heap() -> &'static Heap {
    static HEAP: std::sync::OnceLock<Heap> = std::sync::OnceLock::new();
    HEAP.get_or_init(|| Heap::builder().build().unwrap())
}

#[test]
fn unbound_heap_has_chunks_but_no_keys() {
    let heap = Heap::builder().build().unwrap();
    let buf = heap.alloc(1000).unwrap();
    assert!(chunk_of(buf.as_ptr()).is_some());
    assert_eq!(buf.keys(), None);
    assert_eq!(buf.lkey(), None);
    assert!(matches!(buf.sge(..), Err(Error::NotRegistered { .. })));
    assert!(matches!(buf.remote(), Err(Error::NoRemoteAccess)));
    assert!(matches!(buf.remote_whole_chunk(), Err(Error::NoRemoteAccess)));
    assert!(!buf.is_exposed());
    assert!(mralloc::keys_of(buf.as_ptr()).is_none());
    // Remote rights but no PD: nothing to register with, typed.
    let remote = Heap::builder().access(mralloc::verbs::Access::ALL_REMOTE).build().unwrap();
    let rbuf = remote.alloc(64).unwrap();
    assert!(matches!(rbuf.remote(), Err(Error::NotRegistered { .. })));
    assert!(matches!(rbuf.remote_whole_chunk(), Err(Error::NoWholeChunkAccess)));
    let on_stack = 5u64;
    assert!(chunk_of(&on_stack as *const u64).is_none());
    let boxed = Box::new(5u64);
    assert!(chunk_of(&*boxed as *const u64).is_none(), "the process allocator is not a registered heap here");
}

#[test]
fn bad_requests_are_typed_errors() {
    let heap = Heap::builder().build().unwrap();
    assert!(matches!(heap.alloc(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(heap.alloc(usize::MAX), Err(Error::InvalidArgument(_))));
    let buf = heap.alloc(100).unwrap();
    assert!(matches!(buf.slice(50..101), Err(Error::OutOfBounds { .. })));
    assert_eq!(buf.slice(10..20).unwrap().len(), 10);
    assert!(matches!(Heap::builder().max_chunk(4096).build(), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        Heap::builder().numa(mralloc::heap::NumaPolicy::Node(63)).build(),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn limit_gives_typed_error_and_heap_stays_usable() {
    let heap = Heap::builder().limit(16 << 20).build().unwrap();
    let small = heap.alloc(4096).unwrap();
    match heap.alloc(64 << 20) {
        Err(Error::LimitExceeded { limit, requested, .. }) => {
            assert_eq!(limit, 16 << 20);
            assert!(requested >= 64 << 20);
        }
        other => panic!("expected LimitExceeded, got {other:?}"),
    }
    let again = heap.alloc(8192).unwrap();
    assert!(heap.stats().mapped_bytes <= 16 << 20);
    drop((small, again));
}

#[test]
fn allocation_bigger_than_max_chunk_gets_its_own_chunk() {
    let heap = Heap::builder().max_chunk(4 << 20).build().unwrap();
    let mut big = heap.alloc(40 << 20).unwrap();
    big.fill(3);
    let (base, len) = chunk_of(big.as_ptr()).unwrap();
    assert!(base <= big.as_ptr() as usize && big.as_ptr() as usize + big.len() <= base + len);
}

#[test]
fn purge_and_decay_never_touch_contents() {
    let heap = Heap::builder().build().unwrap();
    let mut keep: Vec<_> = (0..64)
        .map(|i| {
            heap.alloc(64 << 10).map(|mut b| {
                b.fill(i as u8);
                b
            })
        })
        .collect::<Result<_, _>>()
        .unwrap();
    let freed: Vec<_> = (0..64).map(|_| heap.alloc(256 << 10).unwrap()).collect();
    drop(freed);
    let before = heap.stats().mapped_bytes;
    heap.purge().unwrap();
    heap.decay().unwrap();
    assert_eq!(heap.stats().mapped_bytes, before, "no chunk is returned while the heap lives");
    for (i, b) in keep.iter().enumerate() {
        assert!(b.iter().all(|&x| x == i as u8));
    }
    // Reused memory after purge is still inside chunks.
    let again = heap.alloc(256 << 10).unwrap();
    assert!(chunk_of(again.as_ptr()).is_some());
    keep.clear();
}

#[test]
fn dropping_the_heap_releases_its_chunks() {
    let addr;
    {
        let heap = Heap::builder().build().unwrap();
        let b = heap.alloc(1 << 20).unwrap();
        addr = b.as_ptr() as usize;
        assert!(chunk_of(addr as *const u8).is_some());
    }
    assert!(chunk_of(addr as *const u8).is_none(), "chunk still recorded after the heap was dropped");
}

#[test]
fn heaps_do_not_claim_each_others_memory() {
    let a = Heap::builder().build().unwrap();
    let b = Heap::builder().build().unwrap();
    let x = a.alloc(100).unwrap();
    assert!(b.keys(x.as_ptr()).is_none());
    assert_ne!(a.arena_index(), b.arena_index());
}

/// Churn: random sizes 64 B-3 MiB, at most 64 live, 20 000 operations. Mapped bytes (what a bound
/// heap registers) must stay within 2 × peak live + one max chunk.
#[test]
fn churn_keeps_mapped_bytes_bounded() {
    let heap = Heap::builder().build().unwrap();
    let (peak, mapped) = common::churn(&heap, 20_000, 64, 3 << 20);
    let bound = 2 * peak + mralloc::heap::DEFAULT_MAX_CHUNK as u64;
    println!(
        "churn (host, unbound): peak live {peak} B, mapped {mapped} B, bound {bound} B, ratio {:.2}",
        mapped as f64 / peak as f64
    );
    assert!(mapped <= bound, "mapped {mapped} > 2 x peak {peak} + max chunk");
}

#[test]
fn allocator_api2_vec_grows_in_the_heap() {
    let heap = Heap::builder().build().unwrap();
    let mut v = allocator_api2::vec::Vec::new_in(&heap);
    for i in 0..100_000u32 {
        v.push(i);
    }
    let (first, last) = (chunk_of(v.as_ptr()), chunk_of(&v[v.len() - 1] as *const u32));
    assert!(first.is_some());
    assert_eq!(first, last);
    assert_eq!(heap.stats().live_bytes, (v.capacity() * 4) as u64);
    drop(v);
    assert_eq!(heap.stats().live_bytes, 0);
}

#[test]
fn fork_with_a_live_heap_leaves_the_child_working() {
    // jemalloc's fork handlers touch every arena's metadata in the child: metadata chunks must
    // not be excluded from fork (regression: the child died of SIGSEGV).
    let heap = Heap::builder().build().unwrap();
    let b = heap.alloc(1 << 20).unwrap();
    // SAFETY: the child only calls async-signal-safe functions and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: as above.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: pid is our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
    assert!(heap.stats().metadata_bytes > 0);
    drop(b);
}
