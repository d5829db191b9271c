//! The registered heap without a device: an unbound heap runs the same hooks, chunk table and
//! page map (only `ibv_reg_mr` is skipped), so its invariants are checked natively here.

mod common;

use allocator_api2::alloc::Allocator;
use common::model::{op, run_model, Host, SendLive};
use mralloc::heap::{chunk_of, Heap};
use mralloc::Error;
use proptest::prelude::*;
use std::num::NonZeroU64;

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn heap_matches_model_from_two_threads(a in proptest::collection::vec(op(16 << 20), 1..60), b in proptest::collection::vec(op(16 << 20), 1..60)) {
        let heap = Heap::builder().build().unwrap();
        let (la, lb) = std::thread::scope(|s| {
            let ta = s.spawn(|| SendLive(run_model(&heap, &a, 1, &Host)));
            let tb = s.spawn(|| SendLive(run_model(&heap, &b, 2, &Host)));
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

/// `Heap::alloc` zero-fills memory it reuses: a block written, freed and handed out again (the
/// same address, from the thread cache) reads as zeros. (The model test mixes this with purge
/// and decay; the device model also has the NIC read such memory.)
#[test]
fn alloc_zero_fills_reused_dirty_memory() {
    let heap = Heap::builder().build().unwrap();
    for size in [1usize, 64, 4000, 64 << 10, 1 << 20] {
        let layout = std::alloc::Layout::from_size_align(size, 1).unwrap();
        // Free dirty blocks and allocate the same size until a freed block comes back (small
        // sizes from the thread cache at once; large ones from jemalloc's dirty extents, which
        // may hand out another freed block first), so every size shows a dirty block reused.
        let mut freed: Vec<*const u8> = Vec::new();
        let reused = (0..16).find(|_| {
            let p = heap.allocate(layout).unwrap().cast::<u8>();
            // SAFETY: a fresh allocation of `size` bytes, freed once with its layout.
            unsafe {
                std::ptr::write_bytes(p.as_ptr(), 0xA5, size);
                heap.deallocate(p, layout);
            }
            freed.push(p.as_ptr());
            let mut b = heap.alloc(size).unwrap();
            assert!(b.iter().all(|&x| x == 0), "{size}: memory handed out dirty");
            let again = freed.contains(&b.as_ptr());
            b.fill(0xA5);
            freed.push(b.as_ptr());
            again
        });
        println!("{size} B: freed dirty block reused in round {reused:?}");
        assert!(reused.is_some(), "{size}: the freed block never came back: this test shows nothing for this size");
    }
}

/// Huge pages pay for registration (fewer pages to pin); an unbound heap registers nothing,
/// and advised faults may compact memory synchronously (THP `defrag=madvise`): no advice.
#[test]
fn an_unbound_heap_asks_for_no_huge_pages() {
    let heap = Heap::builder().build().unwrap();
    let big = heap.alloc(4 << 20).unwrap();
    let small = heap.alloc(64).unwrap();
    for (b, what) in [(big.as_ptr() as usize, "4 MiB"), (small.as_ptr() as usize, "64 B")] {
        let flags = common::vm_flags(b);
        assert!(!flags.iter().any(|f| f == "hg"), "the {what} buffer's chunk was advised huge pages: {flags:?}");
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

/// Two heaps get arenas (and so chunks) of their own. That neither hands out keys for the
/// other's memory needs registered chunks: `device_heaps_do_not_claim_each_others_memory`.
#[test]
fn heaps_get_arenas_and_chunks_of_their_own() {
    let a = Heap::builder().build().unwrap();
    let b = Heap::builder().build().unwrap();
    assert_ne!(a.arena_index(), b.arena_index());
    let (x, y) = (a.alloc(100).unwrap(), b.alloc(100).unwrap());
    assert_ne!(chunk_of(x.as_ptr()).unwrap(), chunk_of(y.as_ptr()).unwrap(), "one chunk serves one heap");
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

/// hashbrown implements its allocator parameter over allocator-api2 0.2, allocator-api2's own
/// collections over 0.4: the heap is an allocator for both, and what they allocate lives in its
/// chunks and counts in its statistics.
#[test]
fn hashbrown_and_allocator_api2_collections_live_in_the_heap() {
    let heap = Heap::builder().build().unwrap();
    let mut map = hashbrown::HashMap::new_in(&heap);
    for i in 0..50_000u64 {
        map.insert(i, [i; 4]);
    }
    let owned: hashbrown::HashSet<u32, _, Heap> = {
        let mut s = hashbrown::HashSet::with_hasher_in(hashbrown::DefaultHashBuilder::default(), heap.clone());
        s.extend(0..1000);
        s
    };
    let boxed = allocator_api2::boxed::Box::new_in([1u8; 4096], heap.clone());
    for p in [
        map.iter().next().unwrap().0 as *const u64 as *const u8,
        owned.iter().next().unwrap() as *const u32 as *const u8,
        boxed.as_ptr(),
    ] {
        assert!(chunk_of(p).is_some(), "{p:?} is outside the heap's chunks");
    }
    assert_eq!(map[&4242], [4242; 4]);
    assert!(heap.stats().live_bytes > 50_000 * 40, "{:?}", heap.stats());
    drop((map, owned, boxed));
    assert_eq!(heap.stats().live_bytes, 0);
}

/// With feature `bytes`, a buffer becomes `Bytes` without a copy; the memory goes back to the
/// heap with the last clone.
#[cfg(feature = "bytes")]
#[test]
fn a_buffer_becomes_bytes_without_a_copy() {
    let heap = Heap::builder().build().unwrap();
    let mut buf = heap.alloc(8192).unwrap();
    buf[..5].copy_from_slice(b"hello");
    let addr = buf.as_ptr();
    let bytes = buf.into_bytes();
    assert_eq!(bytes.as_ptr(), addr, "no copy");
    let head = bytes.slice(..5);
    drop(bytes);
    assert_eq!(&head[..], b"hello");
    assert!(chunk_of(head.as_ptr()).is_some());
    assert_eq!(heap.stats().live_bytes, 8192, "a slice keeps the buffer");
    drop(head);
    assert_eq!(heap.stats().live_bytes, 0);
}

#[test]
fn fork_with_a_live_heap_leaves_the_child_working() {
    // A scoped heap's data chunks come to fork() children as copies where the kernel copies
    // pinned pages (Linux 5.13+: no fork advice), and are kept out of them otherwise
    // (MADV_DONTFORK, an inaccessible reservation in their place); never zero pages posing as
    // values. Its metadata always comes along, because jemalloc's fork handlers touch every
    // arena's metadata in the child (regression: the child died of SIGSEGV). So in the child:
    // the heap's metadata answers, its data reads as the parent's (or faults), and a heap
    // created there allocates, writes and frees. The fork happens in a re-exec of this
    // binary running only this test, so no other test's thread can hold a lock at the fork.
    // A second re-exec sets RDMAV_FORK_SAFE (rdma-core would enable its fork support and
    // madvise every registration MADV_DONTFORK): mralloc then keeps data chunks out of
    // children on any kernel, so that path runs on this host too.
    const NAME: &str = "fork_with_a_live_heap_leaves_the_child_working";
    if std::env::var_os("MRALLOC_FORK_CHILD").is_none() {
        for (env, expect) in [
            (&[("MRALLOC_FORK_CHILD", "1")][..], "fork: the child"),
            (&[("MRALLOC_FORK_CHILD", "1"), ("RDMAV_FORK_SAFE", "1")][..], "fork: the child found a reservation"),
        ] {
            let text = common::finish_child(common::spawn_test(NAME, false, env), "fork");
            assert!(text.contains(expect), "the fork test did not run in the re-exec ({env:?})");
        }
        return;
    }
    let heap = Heap::builder().build().unwrap();
    let mut b = heap.alloc(1 << 20).unwrap();
    b.fill(0x11);
    // This thread's front cache for the heap, the last it used, keeps a u64's block: the
    // child's first allocation must still be refused (check 10).
    let word = std::alloc::Layout::new::<u64>();
    let p = heap.allocate(word).unwrap();
    // SAFETY: allocated just above with this layout, freed once.
    unsafe { heap.deallocate(p.cast(), word) };
    let live = heap.stats().live_bytes;
    // SAFETY: this process runs one test thread (the main thread only waits for it); the child
    // runs Rust code in the only thread it has, then _exits without unwinding into libtest.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let check = std::panic::AssertUnwindSafe(|| child_after_fork(&heap, &b, live));
        let code = std::panic::catch_unwind(check).unwrap_or(99);
        // SAFETY: leaves the child without running the parent's atexit handlers or destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: pid is our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "child check {} failed (see child_after_fork)", libc::WEXITSTATUS(status));
    assert!(b.iter().all(|&x| x == 0x11), "the parent's buffer is intact");
    assert!(heap.stats().metadata_bytes > 0);
    let big = heap.alloc(40 << 20).unwrap();
    assert!(chunk_of(big.as_ptr()).is_some(), "the parent's heap still grows");
    if children_get_copies() {
        println!("fork: the child saw the heap's metadata and its copy of the data, and used a heap of its own");
    } else {
        println!("fork: the child found a reservation where the data was, saw the heap's metadata, and used a heap of its own");
    }
}

/// Whether mralloc lets fork()ed children copy registered memory here: the kernel copies
/// pinned pages and rdma-core is not asked to madvise registrations (`RDMAV_FORK_SAFE`).
fn children_get_copies() -> bool {
    kernel_copies_pinned_pages_at_fork()
        && std::env::var_os("RDMAV_FORK_SAFE").is_none()
        && std::env::var_os("IBV_FORK_SAFE").is_none()
}

/// What the forked child checks; 0 when all held, else the number of the check that failed.
fn child_after_fork(heap: &Heap, buf: &mralloc::Buffer, live: u64) -> i32 {
    // 10. The parent's heap refuses the child's first allocation, though the thread cache the
    // child copied holds a block of that size and was the last one used.
    if heap.allocate(std::alloc::Layout::new::<u64>()).is_ok() {
        return 10;
    }
    let data = buf.as_ptr();
    // 1. The heap's metadata came along: its statistics answer, unchanged.
    if heap.stats().live_bytes != live {
        return 1;
    }
    // 2. Its data chunk: where the kernel copies pinned pages, the child's copy, holding the
    // parent's bytes. Otherwise not in the child, yet something is mapped there (an
    // inaccessible reservation), so no mapping of the child lands where a parent's buffer was.
    let page = (data as usize & !4095) as *mut libc::c_void;
    if children_get_copies() {
        if !buf.iter().all(|&x| x == 0x11) {
            return 2;
        }
        return child_uses_a_heap_of_its_own(heap, buf, live);
    }
    // SAFETY: asks for a mapping exactly there, refused if anything is mapped (then nothing
    // changes); unmapped again if it was granted.
    let p = unsafe {
        libc::mmap(
            page,
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p != libc::MAP_FAILED {
        // SAFETY: our fresh mapping.
        unsafe { libc::munmap(p, 4096) };
        return 8;
    }
    // The reservation is inaccessible (never the parent's bytes, never zeros).
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let reserved = maps.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (range, perms) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
        let (lo, hi) = range.split_once('-').unwrap_or(("0", "0"));
        let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap_or(0), usize::from_str_radix(hi, 16).unwrap_or(0));
        (lo..hi).contains(&(page as usize)) && perms.starts_with("---")
    });
    if !reserved {
        return 9;
    }
    child_uses_a_heap_of_its_own(heap, buf, live)
}

/// The rest of [`child_after_fork`]'s checks.
fn child_uses_a_heap_of_its_own(heap: &Heap, buf: &mralloc::Buffer, live: u64) -> i32 {
    // 3. A heap made in the child works: a new arena, new chunks through the hooks.
    let fresh = Heap::builder().build().unwrap();
    let mut big = fresh.alloc(40 << 20).unwrap();
    big.fill(0x33);
    let small = fresh.alloc(4096).unwrap();
    if !big.iter().all(|&x| x == 0x33) || !small.iter().all(|&x| x == 0) || chunk_of(big.as_ptr()).is_none() {
        return 3;
    }
    drop((small, big));
    if fresh.stats().live_bytes != 0 {
        return 4;
    }
    // 5. The parent's heap refuses to allocate here, with a typed error (its data chunks are
    // not the child's, and its thread cache holds the parent's pointers).
    if !matches!(heap.alloc(64), Err(mralloc::Error::Forked(_)))
        || heap.allocate(std::alloc::Layout::new::<u64>()).is_ok()
    {
        return 5;
    }
    if !matches!(heap.alloc_uninit(1 << 20), Err(mralloc::Error::Forked(_))) {
        return 6;
    }
    // reserve would grow the parent's arena in the child (new chunks on the parent's PDs).
    let mapped = heap.stats().mapped_bytes;
    if !matches!(heap.reserve(4 << 20), Err(mralloc::Error::Forked(_))) || heap.stats().mapped_bytes != mapped {
        return 10;
    }
    // 6. Dropping the parent's buffer and a handle of its heap here releases nothing (and does
    // not crash on the absent data).
    // SAFETY: an owned copy of the parent's buffer, dropped once here; the original is never
    // dropped in the child (it _exits).
    drop(unsafe { std::ptr::read(buf) });
    drop(heap.clone());
    if heap.stats().live_bytes != live {
        return 7;
    }
    0
}

/// fork() (issue 33): a child reads its copies of typed values that live in a scoped heap — a
/// `Vec<NonZeroU64, Heap>`, a `Box<u64, &Heap>` and `String`s in a `hashbrown::HashMap` whose
/// table is in the heap — and finds the parent's values, never zero bytes posing as them (a
/// `NonZeroU64` of 0, a null `Box`, a `&str` with a null pointer). Dropping them there releases
/// nothing of the parent's. (On kernels that do not copy pinned pages at fork the heap's data
/// is not in the child at all; this host's kernel copies them, so the values must be there.)
#[test]
fn fork_child_reads_the_parents_typed_values() {
    const NAME: &str = "fork_child_reads_the_parents_typed_values";
    if std::env::var_os("MRALLOC_FORK_CHILD").is_none() {
        let text = common::finish_child(common::spawn_test(NAME, false, &[("MRALLOC_FORK_CHILD", "1")]), "fork");
        assert!(text.contains("fork: the child read"), "the fork test did not run in the re-exec");
        return;
    }
    assert!(
        kernel_copies_pinned_pages_at_fork(),
        "this test expects a kernel that copies pinned pages at fork (Linux 5.13+)"
    );
    let heap = Heap::builder().build().unwrap();
    let mut v: allocator_api2::vec::Vec<NonZeroU64, Heap> = allocator_api2::vec::Vec::new_in(heap.clone());
    v.extend((1..=10_000u64).map(|i| NonZeroU64::new(i * 7919).unwrap()));
    let b = allocator_api2::boxed::Box::new_in(0xdead_beef_u64, &heap);
    let mut map = hashbrown::HashMap::new_in(&heap);
    for i in 0..500 {
        map.insert(format!("key {i}"), format!("value {i} ").repeat(3));
    }
    for p in [
        v.as_ptr().cast::<u8>(),
        (&*b as *const u64).cast(),
        map.iter().next().unwrap().0 as *const String as *const u8,
    ] {
        assert!(chunk_of(p).is_some(), "{p:?} is outside the heap's chunks");
    }
    // This thread's front cache for the heap, the last it used, keeps a u64's block: the
    // child's first allocation must still be refused (check 10).
    let word = std::alloc::Layout::new::<u64>();
    let p = heap.allocate(word).unwrap();
    // SAFETY: allocated just above with this layout, freed once.
    unsafe { heap.deallocate(p.cast(), word) };
    let live = heap.stats().live_bytes;
    // SAFETY: this process runs one test thread (the main thread only waits for it); the child
    // runs Rust code in the only thread it has, then _exits without unwinding into libtest.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let check = std::panic::AssertUnwindSafe(|| child_reads_copies(&heap, v, b, map, live));
        let code = std::panic::catch_unwind(check).unwrap_or(99);
        // SAFETY: leaves the child without running the parent's atexit handlers or destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: pid is our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x} (killed by signal {})", libc::WTERMSIG(status));
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "child check {} failed (see child_reads_copies)",
        libc::WEXITSTATUS(status)
    );
    // The parent's values are intact and still its own.
    assert!(v.iter().zip(1u64..).all(|(x, i)| x.get() == i * 7919));
    assert_eq!(*b, 0xdead_beef);
    assert_eq!(map["key 499"], "value 499 ".repeat(3));
    v.push(NonZeroU64::MIN);
    map.insert("after".into(), "fork".into());
    drop((v, b, map));
    assert_eq!(heap.stats().live_bytes, 0);
    println!("fork: the child read the parent's Vec<NonZeroU64>, Box and HashMap<String, String> from the heap");
}

/// What the forked child checks: 0 when all held, else the number of the check that failed.
/// The raw checks come first: they read the heap's bytes as plain integers, which is sound
/// whatever the bytes are (zeros included), before any typed value is used.
fn child_reads_copies(
    heap: &Heap,
    v: allocator_api2::vec::Vec<NonZeroU64, Heap>,
    b: allocator_api2::boxed::Box<u64, &Heap>,
    map: hashbrown::HashMap<String, String, hashbrown::DefaultHashBuilder, &Heap>,
    live: u64,
) -> i32 {
    let raw = v.as_ptr().cast::<u64>();
    // SAFETY: v.len() initialised elements, mapped in the child (or the child faults): read as
    // plain u64s, any value is valid.
    if (0..v.len()).any(|i| unsafe { raw.add(i).read_volatile() } != (i as u64 + 1) * 7919) {
        return 1;
    }
    // SAFETY: as above, one u64.
    if unsafe { (&*b as *const u64).read_volatile() } != 0xdead_beef {
        return 2;
    }
    if !v.iter().zip(1u64..).all(|(x, i)| x.get() == i * 7919) || *b != 0xdead_beef {
        return 3;
    }
    if map.len() != 500 || (0..500).any(|i| map.get(&format!("key {i}")) != Some(&format!("value {i} ").repeat(3))) {
        return 4;
    }
    if map.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() == 0 {
        return 5;
    }
    // Dropping the copies releases nothing of the parent's heap (and runs the Strings' drops
    // on the child's copies of them).
    drop((v, b, map));
    if heap.stats().live_bytes != live {
        return 6;
    }
    0
}

/// Whether the running kernel copies pinned anonymous pages into a fork()ed child (Linux 5.13+).
fn kernel_copies_pinned_pages_at_fork() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (5, 13)
}

/// The front cache: a freed buffer comes back to the next allocation of its size class on the
/// same thread (even for another size of that class), counted in `thread_cached_bytes`
/// meanwhile and never in `live_bytes`.
#[test]
fn freed_buffers_come_back_from_the_thread_cache() {
    let heap = Heap::builder().build().unwrap();
    // (size, another size of its jemalloc class)
    for (size, same_class) in [(1usize, 8usize), (100, 112), (4000, 4096), (57345, 65536), (1_044_481, 1 << 20)] {
        let before = heap.stats().thread_cached_bytes;
        let b = heap.alloc(size).unwrap();
        let p = b.as_ptr();
        drop(b);
        let s = heap.stats();
        assert_eq!(s.live_bytes, 0, "{size}");
        assert_eq!(s.thread_cached_bytes, before + same_class as u64, "{size}: the class's bytes are cached");
        let b = heap.alloc(same_class).unwrap();
        assert_eq!(b.as_ptr(), p, "{size}: the cached block serves its class");
        assert_eq!(heap.stats().thread_cached_bytes, before, "{size}");
    }
    let cached = heap.stats().thread_cached_bytes;
    // Sizes past the cache and over-aligned requests go straight to jemalloc.
    let big = heap.alloc(2 << 20).unwrap();
    drop(big);
    let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
    let p = heap.allocate(layout).unwrap();
    // SAFETY: allocated just above with this layout, freed once.
    unsafe { heap.deallocate(p.cast(), layout) };
    assert_eq!(heap.stats().thread_cached_bytes, cached, "not cached");
}

#[test]
fn the_thread_cache_keeps_at_most_its_bound() {
    let heap = Heap::builder().thread_cache(256 << 10).build().unwrap();
    let bufs: Vec<_> = (0..64).map(|_| heap.alloc(16 << 10).unwrap()).collect();
    drop(bufs);
    let s = heap.stats();
    assert!(s.thread_cached_bytes > 0 && s.thread_cached_bytes <= 256 << 10, "{}", s.thread_cached_bytes);
    // Over the byte bound, a freed object goes straight back.
    let small: Vec<_> = (0..1000).map(|_| heap.alloc(64).unwrap()).collect();
    drop(small);
    let s = heap.stats();
    assert!(s.thread_cached_bytes <= 256 << 10, "{}", s.thread_cached_bytes);
    assert_eq!(s.live_bytes, 0);

    // Within it, a small class's magazine (at most 2048 objects of 64 B) overflows: each time
    // it is full, its older half (1024 objects, 64 KiB) goes to the heap's depot while that
    // has room (as much as a thread's budget: 4 halves), to jemalloc after that, and the freed
    // object is kept. After 10000 frees (8 halves) the magazine holds some, never a full
    // magazine's worth (which is what keeping the first 2048 and handing every later one
    // straight back would leave).
    let fresh = Heap::builder().thread_cache(256 << 10).build().unwrap();
    let small: Vec<_> = (0..10000).map(|_| fresh.alloc(64).unwrap()).collect();
    let live = fresh.stats().jemalloc_allocated;
    drop(small);
    let s = fresh.stats();
    assert!(s.thread_cached_bytes > 0 && s.thread_cached_bytes < 2048 * 64, "{}", s.thread_cached_bytes);
    assert_eq!(s.depot_bytes, 256 << 10, "the depot keeps 4 halves, its bound");
    // What left the magazine past the depot went back to jemalloc (its own thread cache counts
    // as allocated).
    if let (Some(live), Some(now)) = (live, s.jemalloc_allocated) {
        assert!(now < live, "jemalloc counts {now} bytes after the frees, {live} before");
    }
    fresh.flush_thread_cache().unwrap();
    let s = fresh.stats();
    assert_eq!((s.thread_cached_bytes, s.depot_bytes), (0, 0), "flushed, the depot too");

    // The budget is room the size classes reserve as they fill: room a class reserved and no
    // longer uses goes to a class that needs it. 16 objects of 16 KiB reserve 256 KiB (and
    // their 16 slots, 8 bytes each, which the budget pays for too: 4 KiB more is room for
    // those); once they are allocated again, 1 KiB objects are kept in their place.
    let moving = Heap::builder().thread_cache((256 << 10) + 4096).build().unwrap();
    let big: Vec<_> = (0..16).map(|_| moving.alloc(16 << 10).unwrap()).collect();
    drop(big);
    assert_eq!(moving.stats().thread_cached_bytes, 256 << 10);
    let big: Vec<_> = (0..16).map(|_| moving.alloc(16 << 10).unwrap()).collect();
    assert_eq!(moving.stats().thread_cached_bytes, 0);
    let small: Vec<_> = (0..64).map(|_| moving.alloc(1024).unwrap()).collect();
    drop(small);
    assert_eq!(moving.stats().thread_cached_bytes, 64 << 10, "the 16 KiB class's unused room went to 1 KiB");
    // The budget is full again (64 KiB kept, the 16 KiB class holds room for 12): of 16 more
    // frees of 16 KiB the first 12 are kept; the 13th finds the magazine full and unable to
    // grow, which hands its older half (6) to the heap's depot and keeps on: 10 kept.
    drop(big);
    let s = moving.stats();
    assert_eq!((s.thread_cached_bytes, s.depot_bytes), ((64 << 10) + 10 * (16 << 10), 6 * (16 << 10)));

    let off = Heap::builder().thread_cache(0).build().unwrap();
    let b = off.alloc(64).unwrap();
    let p = b.as_ptr();
    drop(b);
    assert_eq!(off.stats().thread_cached_bytes, 0, "thread_cache(0) keeps nothing");
    drop(off.alloc(64).unwrap());
    let _ = p;
}

/// Buffers freed on another thread go into that thread's cache; its exit returns them.
#[test]
fn a_thread_returns_its_cache_when_it_exits() {
    let heap = Heap::builder().build().unwrap();
    let bufs: Vec<_> = (0..8).map(|_| heap.alloc(4096).unwrap()).collect();
    // With the 8 buffers live (and whatever this thread's caches hold, which stays).
    let before = heap.stats().jemalloc_allocated;
    let h = &heap;
    std::thread::scope(|s| {
        // Joined explicitly: the scope's own wait ends before the thread's exit (its caches
        // go back in thread-local destructors), a join waits for both.
        s.spawn(move || {
            drop(bufs);
            assert!(h.stats().thread_cached_bytes >= 8 * 4096, "kept by the freeing thread");
            // This thread's allocations take them back.
            let again: Vec<_> = (0..8).map(|_| h.alloc(4096).unwrap()).collect();
            assert_eq!(h.stats().thread_cached_bytes, 0);
            drop(again);
        })
        .join()
        .unwrap();
    });
    let s = heap.stats();
    assert_eq!(s.thread_cached_bytes, 0, "the exited thread's cache went back to the heap");
    assert_eq!(s.live_bytes, 0);
    // Back in the arena, not just out of the stats: jemalloc counts no more than before.
    if let (Some(b), Some(a)) = (before, s.jemalloc_allocated) {
        assert!(
            a + 8 * 4096 <= b,
            "jemalloc counts {a} bytes after the thread exited, {b} with the 8 buffers live: its cache was not flushed"
        );
    }
}

/// Buffers allocated and freed by a thread-local destructor that runs after the thread's caches
/// are gone (no front: the heap's arena is used directly) are counted and returned like any
/// other, at every kind of size (small class, large class, not a class, beyond the front's
/// 1 MiB): afterwards nothing is live and the arena holds no more than before.
#[test]
fn buffers_freed_while_a_thread_exits_go_back_to_the_arena() {
    use mralloc::heap::Buffer;
    use std::cell::RefCell;
    struct Late(RefCell<Vec<Buffer>>, RefCell<Option<(Heap, std::sync::mpsc::Sender<u64>)>>);
    impl Drop for Late {
        fn drop(&mut self) {
            // Runs after the heap's caches were destroyed (destructors run in reverse order of
            // registration, and this one was registered first).
            let (heap, tx) = self.1.borrow_mut().take().unwrap();
            let during = heap.stats().live_bytes;
            let late: Vec<Buffer> = SIZES.iter().map(|&n| heap.alloc(n).unwrap()).collect();
            let with_late = heap.stats().live_bytes;
            drop(late);
            self.0.borrow_mut().clear();
            let _ = tx.send(during);
            let _ = tx.send(with_late - during);
            let _ = tx.send(heap.stats().live_bytes);
        }
    }
    thread_local!(static LATE: Late = const { Late(RefCell::new(Vec::new()), RefCell::new(None)) });
    const SIZES: [usize; 6] = [100, 4096, 40_000, 300_000, (1 << 20) + 64, 3 << 20];
    let total: u64 = SIZES.iter().map(|&n| n as u64).sum();

    let heap = Heap::builder().build().unwrap();
    let warm: Vec<_> = SIZES.iter().map(|&n| heap.alloc(n).unwrap()).collect();
    drop(warm);
    let before = heap.stats().jemalloc_allocated;
    let (tx, rx) = std::sync::mpsc::channel();
    let h = heap.clone();
    std::thread::spawn(move || {
        LATE.with(|l| *l.1.borrow_mut() = Some((h.clone(), tx)));
        // The caches are created after LATE's destructor was registered, so they go first.
        let bufs: Vec<Buffer> = SIZES.iter().map(|&n| h.alloc(n).unwrap()).collect();
        LATE.with(|l| l.0.borrow_mut().extend(bufs));
    })
    .join()
    .unwrap();
    let during = rx.recv().unwrap();
    assert_eq!(during, total, "the thread's buffers, counted after its caches retired");
    assert_eq!(rx.recv().unwrap(), total, "allocations without a front are counted");
    assert_eq!(rx.recv().unwrap(), 0, "and so are their frees");
    let s = heap.stats();
    assert_eq!(s.live_bytes, 0);
    if let (Some(b), Some(a)) = (before, s.jemalloc_allocated) {
        assert!(a <= b, "the arena holds {a} bytes after the thread, {b} before: frees without a front leaked");
    }
    // The arena reuses what came back: the same sizes again make no chunk.
    let chunks = s.chunks;
    let again: Vec<_> = SIZES.iter().map(|&n| heap.alloc(n).unwrap()).collect();
    assert_eq!(heap.stats().chunks, chunks);
    drop(again);
}

/// Dropping a heap returns the caches of threads that are still running; such a thread exiting
/// later must not touch its (freed) cache.
#[test]
fn dropping_a_heap_returns_every_threads_cache() {
    let heap = Heap::builder().build().unwrap();
    let h2 = heap.clone();
    let (cached_tx, cached_rx) = std::sync::mpsc::channel();
    let (exit_tx, exit_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let b = h2.alloc(4096).unwrap();
        let addr = b.as_ptr() as usize;
        drop(b);
        drop(h2);
        cached_tx.send(addr).unwrap();
        exit_rx.recv().unwrap();
    });
    let addr = cached_rx.recv().unwrap();
    assert!(heap.stats().thread_cached_bytes >= 4096);
    drop(heap);
    assert!(chunk_of(addr as *const u8).is_none(), "the heap was torn down with a thread's cache still full");
    exit_tx.send(()).unwrap();
    t.join().unwrap();
}

/// Freed buffers parked in a thread's cache never make the heap's limit refuse an allocation:
/// when a new chunk is refused, the thread hands its cache back and tries again.
#[test]
fn kept_buffers_do_not_make_the_limit_fail_early() {
    let heap = Heap::builder().limit(8 << 20).thread_cache(64 << 20).build().unwrap();
    // Buffers of many large classes (36 KiB .. 864 KiB, whose classes end at 896 KiB; each class
    // keeps at most 1 MiB) until the limit refuses one.
    let mut held = Vec::new();
    let mut size = 36 << 10;
    loop {
        match heap.alloc(size) {
            Ok(b) => held.push(b),
            Err(Error::LimitExceeded { .. }) => break,
            Err(e) => panic!("{e}"),
        }
        size = if size >= 864 << 10 { 36 << 10 } else { size + (36 << 10) };
    }
    drop(held);
    let cached = heap.stats().thread_cached_bytes;
    assert!(cached >= 2 << 20, "the test needs much kept to show anything: {cached}");
    // 1 MiB is a class none of the kept buffers has: it needs memory the cache holds.
    let big = heap.alloc(1 << 20).expect("kept memory was given back");
    assert!(heap.stats().thread_cached_bytes < cached, "the allocation came from memory the cache had kept");
    drop(big);
}

#[test]
fn reserve_maps_ahead_so_later_allocations_make_no_chunk() {
    let heap = Heap::builder().build().unwrap();
    heap.reserve(64 << 20).unwrap();
    let after = heap.stats();
    assert!(after.mapped_bytes >= 64 << 20, "{after:?}");
    assert_eq!(after.live_bytes, 0, "reserve allocates nothing: {after:?}");
    // 50 MiB of buffers, large and small, all live at once (the 40 large ones, just over 1 MiB,
    // take the 1.25 MiB class): served from the reserved chunks.
    let mut keep = Vec::new();
    for i in 0..40 {
        keep.push(heap.alloc((1 << 20) + i * 4096).unwrap());
    }
    for i in 0..1000 {
        keep.push(heap.alloc(64 + i).unwrap());
    }
    let used = heap.stats();
    assert_eq!((used.chunks, used.mapped_bytes), (after.chunks, after.mapped_bytes), "{used:?}");
    assert!(used.live_bytes >= 40 << 20);
    // Without the reservation the same allocations grow a fresh heap.
    let fresh = Heap::builder().build().unwrap();
    let before = fresh.stats().mapped_bytes;
    let b = fresh.alloc(40 << 20).unwrap();
    assert!(fresh.stats().mapped_bytes > before);
    drop((b, keep));
}

/// The benchmark's case: a heap grows to 256 MiB of live 1 MiB buffers. After `reserve` of the
/// buffers plus a sixteenth, no allocation makes a chunk; without it, growth maps little more
/// than the buffers (jemalloc's large size classes kept: with page-granular large sizes each
/// 1 MiB buffer cut from fresh memory cost 1.25 MiB, 343 MiB mapped in all, and the reserved
/// heap made a chunk at the 246th buffer).
#[test]
fn reserve_covers_a_growth_in_rdma_sized_buffers() {
    // With jemalloc's large size classes (mralloc's recommended options; feature `global` or
    // `malloc_conf!`) growth maps little more than the buffers; with this jemalloc build's default
    // page sizing, a quarter more (documented in RECOMMENDED_MALLOC_CONF). Reserving works either way.
    // SAFETY: the option is a bool.
    let page_sizing = unsafe { tikv_jemalloc_ctl::raw::read::<bool>(b"opt.disable_large_size_classes\0") }.unwrap();
    let bound = if page_sizing { 360 << 20 } else { 300 << 20 };
    let layout = std::alloc::Layout::from_size_align(1 << 20, 8).unwrap();
    for reserve in [true, false] {
        let heap = Heap::builder().build().unwrap();
        if reserve {
            heap.reserve((256 << 20) + (16 << 20)).unwrap();
        }
        let before = heap.stats();
        let held: Vec<_> = (0..256).map(|_| heap.allocate(layout).unwrap()).collect();
        let after = heap.stats();
        if reserve {
            assert_eq!((after.chunks, after.mapped_bytes), (before.chunks, before.mapped_bytes), "{after:?}");
        } else {
            assert!(after.mapped_bytes < bound, "256 MiB of buffers mapped {} MiB", after.mapped_bytes >> 20);
        }
        for p in held {
            // SAFETY: allocated above with `layout`, freed once.
            unsafe { heap.deallocate(p.cast(), layout) };
        }
    }
}

#[test]
fn reserve_beyond_the_limit_is_a_typed_error_and_allocates_nothing() {
    let heap = Heap::builder().limit(16 << 20).build().unwrap();
    let before = heap.stats().mapped_bytes;
    for bytes in [64 << 20, usize::MAX] {
        match heap.reserve(bytes) {
            Err(Error::LimitExceeded { limit, requested, .. }) => assert_eq!((limit, requested), (16 << 20, bytes)),
            other => panic!("expected LimitExceeded, got {other:?}"),
        }
    }
    assert_eq!(heap.stats().mapped_bytes, before, "refused before mapping anything");
    assert_eq!(heap.stats().live_bytes, 0);
    // Close to the limit: smaller blocks still fit where a half-chunk block would not.
    let near = Heap::builder().limit(72 << 20).build().unwrap();
    near.reserve(64 << 20).unwrap();
    assert!(near.stats().mapped_bytes >= 64 << 20);
    let b = heap.alloc(4096).unwrap();
    assert_eq!(b.len(), 4096);
}

#[test]
fn zeroed_allocations_of_fresh_chunk_pages_are_not_written() {
    // Fresh chunk pages are zero already: a zeroed allocation from them must not memset (which
    // would fault every page in). mincore shows which pages are resident.
    let heap = Heap::builder().build().unwrap();
    let len = 32 << 20;
    let b = heap.alloc_zeroed(len).unwrap();
    let page = 4096;
    let start = (b.as_ptr() as usize).next_multiple_of(page);
    let pages = (b.as_ptr() as usize + len - start) / page;
    let mut vec = vec![0u8; pages];
    // SAFETY: [start, start + pages * page) lies inside the buffer's mapping; vec has one byte
    // per page.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, pages * page, vec.as_mut_ptr()) };
    assert_eq!(rc, 0);
    let resident = vec.iter().filter(|&&v| v & 1 != 0).count();
    assert!(resident * 20 < pages, "{resident} of {pages} pages were touched by a zeroed allocation of fresh memory");
    assert!(b.iter().step_by(page).all(|&x| x == 0));
}

#[test]
fn an_uninit_buffer_shows_only_what_was_written() {
    let heap = Heap::builder().build().unwrap();
    // Dirty the memory first, so that an uninitialised allocation really holds old bytes.
    heap.alloc(1 << 16).unwrap().fill(0xee);
    let mut u = heap.alloc_uninit(1 << 16).unwrap();
    assert_eq!((u.len(), u.init_len()), (1 << 16, 0));
    assert!(u.init_mut().is_empty());
    u.extend_from_slice(b"hello").unwrap();
    assert_eq!(u.init_mut(), b"hello");
    assert_eq!(u.spare_mut().len(), (1 << 16) - 5);
    match u.extend_from_slice(&vec![1u8; 1 << 16]) {
        Err(Error::OutOfBounds { offset: 5, .. }) => {}
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
    // Written through the spare bytes, then marked.
    u.spare_mut()[..3].copy_from_slice(&[std::mem::MaybeUninit::new(b'!'); 3]);
    // SAFETY: bytes 5..8 were just written, 0..5 before.
    unsafe { u.set_init(8) };
    let b = u.into_init();
    assert_eq!(&b[..], b"hello!!!");
    assert_eq!(heap.stats().live_bytes, 1 << 16, "the whole allocation stays live");
    drop(b);
    assert_eq!(heap.stats().live_bytes, 0);
    // into_buffer zeroes what nothing wrote.
    let mut u = heap.alloc_uninit(4096).unwrap();
    u.extend_from_slice(&[7; 10]).unwrap();
    let b = u.into_buffer();
    assert_eq!(b.len(), 4096);
    assert!(b[..10].iter().all(|&x| x == 7) && b[10..].iter().all(|&x| x == 0));
    let mut u = heap.alloc_uninit(100).unwrap();
    u.fill_rest(3);
    assert_eq!(u.init_len(), 100);
    assert!(u.into_init().iter().all(|&x| x == 3));
    assert!(matches!(heap.alloc_uninit(0), Err(Error::InvalidArgument(_))));
}

/// Large buffers freed and allocated again reuse the heap's chunks: jemalloc offers freed large
/// extents back to the extent hooks (eager purge above 8 MiB, `arena.N.purge`), and the heap
/// refuses (its `dalloc` hook opts out), so jemalloc keeps and reuses them. A hook that accepted
/// would let jemalloc forget memory that stays registered, and map more for every round.
#[test]
fn freed_large_buffers_are_reused_not_given_up() {
    let heap = Heap::builder().build().unwrap();
    drop(heap.alloc(24 << 20).unwrap());
    let after_first = heap.stats();
    for _ in 0..10 {
        let b = heap.alloc(24 << 20).unwrap();
        drop(b);
        heap.purge().unwrap();
    }
    let s = heap.stats();
    assert_eq!(
        (s.chunks, s.mapped_bytes),
        (after_first.chunks, after_first.mapped_bytes),
        "ten more 24 MiB rounds mapped more memory: freed extents were given up"
    );
}

/// jemalloc's `opt.zero` (`_RJEM_MALLOC_CONF=zero:true`: every allocation zeroed by jemalloc)
/// would hand the alloc hook a 2 MiB-aligned data extent with the arguments of a metadata
/// block, which is never registered: no heap is built (checked in a child process started
/// with the option).
#[test]
fn a_heap_refuses_jemalloc_zeroing_everything() {
    const NAME: &str = "a_heap_refuses_jemalloc_zeroing_everything";
    if std::env::var_os("MRALLOC_ZERO_CHILD").is_some() {
        // SAFETY: opt.zero is a bool mallctl.
        let zero: bool = unsafe { tikv_jemalloc_ctl::raw::read(b"opt.zero\0") }.unwrap();
        assert!(zero, "the child runs without opt.zero");
        match Heap::builder().build() {
            Err(mralloc::Error::InvalidArgument(m)) => assert!(m.contains("opt.zero"), "{m}"),
            other => panic!("a heap under opt.zero: {:?}", other.map(|_| ())),
        }
        return;
    }
    let env = [("MRALLOC_ZERO_CHILD", "1"), ("_RJEM_MALLOC_CONF", "zero:true")];
    let text = common::finish_child(common::spawn_test(NAME, false, &env), "opt.zero");
    assert!(text.contains("1 passed"), "the child ran no test");
}

/// Bytes of this process's mappings advised `MADV_NOHUGEPAGE` (`nh` in /proc/self/smaps).
fn no_huge_page_bytes() -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut size, mut total) = (0u64, 0u64);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) {
                size = hi - lo;
                continue;
            }
        }
        if line.strip_prefix("VmFlags:").is_some_and(|f| f.split_whitespace().any(|f| f == "nh")) {
            total += size;
        }
    }
    total
}

/// jemalloc touches ~90 KiB of a heap's 2 MiB metadata block: it refuses transparent huge pages,
/// so that THP `always` does not make all of it resident at the first touch (checked in a child
/// process, where no other test's heap comes or goes meanwhile).
#[test]
fn metadata_blocks_refuse_huge_pages() {
    const NAME: &str = "metadata_blocks_refuse_huge_pages";
    if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
        println!("{NAME}: this kernel has no transparent huge pages (no advice to check)");
        return;
    }
    if std::env::var_os("MRALLOC_NH_CHILD").is_some() {
        let before = no_huge_page_bytes();
        let heap = Heap::builder().build().unwrap();
        let meta = heap.stats().metadata_bytes;
        assert!(meta > 0);
        let after = no_huge_page_bytes();
        assert_eq!(after.checked_sub(before), Some(meta), "the metadata block is not advised MADV_NOHUGEPAGE");
        return;
    }
    let text = common::finish_child(common::spawn_test(NAME, false, &[("MRALLOC_NH_CHILD", "1")]), "nh");
    assert!(text.contains("1 passed"), "the child ran no test");
}
