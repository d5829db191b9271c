//! The registered heap without a device: an unbound heap runs the same hooks, chunk table and
//! page map (only `ibv_reg_mr` is skipped), so its invariants are checked natively here.

mod common;

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;

use allocator_api2::alloc::Allocator;
use common::pattern;
use mralloc::heap::{chunk_of, Heap};
use mralloc::Error;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc { size: usize, align_log2: u32 },
    Free(usize),
    Resize(usize, usize),
    Write(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (prop_oneof![8 => 1usize..4096, 3 => 4096usize..(1 << 20), 1 => (1usize << 20)..(16 << 20)], 0u32..=12)
            .prop_map(|(size, align_log2)| Op::Alloc { size, align_log2 }),
        3 => any::<usize>().prop_map(Op::Free),
        2 => (any::<usize>(), 1usize..(2 << 20)).prop_map(|(i, n)| Op::Resize(i, n)),
        2 => any::<usize>().prop_map(Op::Write),
    ]
}

struct Live {
    ptr: NonNull<u8>,
    layout: Layout,
    seed: u64,
}

/// Runs `ops` against `heap` and a model; checks every invariant after each step. Returns the
/// live bytes left (the caller frees nothing: it checks them against the stats, then frees).
fn run_model(heap: &Heap, ops: &[Op], salt: u64) -> Vec<Live> {
    let alloc = heap;
    let mut live: Vec<Live> = Vec::new();
    let check = |l: &Live| {
        // SAFETY: l is a live allocation of l.layout.size() bytes.
        let bytes = unsafe { std::slice::from_raw_parts(l.ptr.as_ptr(), l.layout.size()) };
        common::assert_bytes_eq(bytes, &pattern(l.seed, l.layout.size()), "contents preserved");
        assert_eq!(l.ptr.as_ptr() as usize % l.layout.align(), 0, "alignment");
        let first = chunk_of(l.ptr.as_ptr()).expect("first byte lies in a heap chunk");
        let last = chunk_of(l.ptr.as_ptr().wrapping_add(l.layout.size() - 1)).expect("last byte in a chunk");
        assert_eq!(first, last, "an allocation spans exactly one chunk");
    };
    for (step, op) in ops.iter().enumerate() {
        let seed = salt ^ (step as u64) << 8;
        match *op {
            Op::Alloc { size, align_log2 } => {
                let layout = Layout::from_size_align(size, 1 << align_log2).unwrap();
                let p = alloc.allocate(layout).expect("allocation").cast::<u8>();
                // SAFETY: fresh allocation of layout.size() bytes.
                unsafe { std::ptr::copy_nonoverlapping(pattern(seed, size).as_ptr(), p.as_ptr(), size) };
                live.push(Live { ptr: p, layout, seed });
            }
            Op::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                check(&l);
                // SAFETY: allocated by `alloc` with l.layout, freed once.
                unsafe { alloc.deallocate(l.ptr, l.layout) };
            }
            Op::Resize(i, new_size) if !live.is_empty() => {
                let k = i % live.len();
                let l = &mut live[k];
                check(l);
                let new = Layout::from_size_align(new_size, l.layout.align()).unwrap();
                // SAFETY: l.ptr was allocated by `alloc` with l.layout.
                let p = unsafe {
                    if new.size() >= l.layout.size() {
                        alloc.grow(l.ptr, l.layout, new)
                    } else {
                        alloc.shrink(l.ptr, l.layout, new)
                    }
                }
                .expect("resize")
                .cast::<u8>();
                let keep = l.layout.size().min(new_size);
                // SAFETY: p is live for new_size bytes.
                let kept = unsafe { std::slice::from_raw_parts(p.as_ptr(), keep) };
                common::assert_bytes_eq(kept, &pattern(l.seed, l.layout.size())[..keep], "resize keeps the prefix");
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(pattern(seed, new_size).as_ptr(), p.as_ptr(), new_size) };
                *l = Live { ptr: p, layout: new, seed };
            }
            Op::Write(i) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                check(l);
                // SAFETY: l is live for its size.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        pattern(seed, l.layout.size()).as_ptr(),
                        l.ptr.as_ptr(),
                        l.layout.size(),
                    )
                };
                l.seed = seed;
            }
            _ => {}
        }
    }
    // No overlap among live allocations.
    let mut spans: BTreeMap<usize, usize> = BTreeMap::new();
    for l in &live {
        check(l);
        spans.insert(l.ptr.as_ptr() as usize, l.layout.size());
    }
    let mut end = 0;
    for (&start, &len) in &spans {
        assert!(start >= end, "allocations overlap at {start:#x}");
        end = start + len;
    }
    live
}

// SAFETY note for the test: Live holds raw pointers; it is only moved across the scoped thread
// boundary and used with the heap that allocated it.
struct SendLive(Vec<Live>);
// SAFETY: the pointers are plain heap memory owned by the vector's user.
unsafe impl Send for SendLive {}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn heap_matches_model_from_two_threads(a in proptest::collection::vec(op(), 1..60), b in proptest::collection::vec(op(), 1..60)) {
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
            unsafe { (&heap).deallocate(l.ptr, l.layout) };
        }
        prop_assert_eq!(heap.stats().live_bytes, 0);
    }
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
    assert!(mralloc::keys_of(buf.as_ptr()).is_none());
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
