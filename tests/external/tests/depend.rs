//! mralloc with default features in a program that defines jemalloc's start-up options itself:
//! it links (mralloc defines no `_rjem_malloc_conf` of its own without `global`), jemalloc runs
//! with this program's options, and scoped heaps work under them (page-sized large classes,
//! jemalloc's default here) — collections included.

use std::alloc::Layout;

use allocator_api2::alloc::Allocator;
use mralloc::heap::{chunk_of, Heap};

#[repr(transparent)]
struct Conf(*const std::ffi::c_char);
// SAFETY: points at an immutable static string.
unsafe impl Sync for Conf {}

/// This program's own options (jemalloc reads them before its first allocation).
#[no_mangle]
#[used]
static _rjem_malloc_conf: Conf = Conf(c"dirty_decay_ms:4321,narenas:3".as_ptr());

fn opt<T: Copy>(name: &str) -> T {
    let name = format!("opt.{name}\0");
    // SAFETY: each caller names an option of type T.
    unsafe { tikv_jemalloc_ctl::raw::read::<T>(name.as_bytes()) }.unwrap()
}

#[test]
fn jemalloc_runs_with_this_programs_options() {
    // Allocate through a heap first, so jemalloc has started.
    let heap = Heap::builder().build().unwrap();
    drop(heap.alloc(64).unwrap());
    assert_eq!(opt::<isize>("dirty_decay_ms"), 4321);
    assert_eq!(opt::<u32>("narenas"), 3);
    // Nothing of mralloc's: jemalloc's defaults for what this program did not set.
    assert!(opt::<bool>("disable_large_size_classes"));
    assert_ne!(opt::<usize>("oversize_threshold"), 0);
}

#[test]
fn collections_allocate_inside_the_heaps_chunks() {
    let heap = Heap::builder().build().unwrap();
    let mut map = hashbrown::HashMap::new_in(&heap);
    for i in 0..10_000u64 {
        map.insert(i, i * 3);
    }
    assert_eq!(map[&777], 2331);
    let mut v = allocator_api2::vec::Vec::new_in(&heap);
    v.extend(0..100_000u32);
    let b = allocator_api2::boxed::Box::new_in([7u8; 100], heap.clone());
    let buf = heap.alloc(1 << 20).unwrap();
    for p in [v.as_ptr().cast::<u8>(), b.as_ptr(), buf.as_ptr()] {
        assert!(chunk_of(p).is_some(), "{p:?} is not in a chunk of the heap");
    }
    let (k, _) = map.iter().next().unwrap();
    assert!(chunk_of(k as *const u64).is_some(), "the map's table is not in a chunk of the heap");
    let live = heap.stats().live_bytes;
    assert!(live >= (1 << 20) + 400_000, "{live}");
}

/// Under page-sized large classes, sizes of one of the heap's classes are different jemalloc
/// classes: memory allocated on one thread and freed on another (or without a thread cache)
/// must still be freed with the size it was allocated with.
#[test]
fn large_sizes_churn_across_threads_under_page_classes() {
    let heap = Heap::builder().thread_cache(0).build().unwrap();
    let cached = Heap::builder().build().unwrap();
    for h in [heap, cached] {
        let sizes: Vec<usize> = (0..200).map(|i| 16 * 1024 + i * 5000 + (i % 7) * 13).collect();
        let held: Vec<_> = sizes.iter().map(|&s| (h.alloc(s).unwrap(), s)).collect();
        std::thread::spawn(move || {
            for (b, s) in held {
                assert_eq!(b.len(), s);
                drop(b);
            }
        })
        .join()
        .unwrap();
        for round in 0..20 {
            let layouts: Vec<_> = sizes.iter().map(|&s| Layout::from_size_align(s + round, 8).unwrap()).collect();
            let ptrs: Vec<_> = layouts.iter().map(|&l| h.allocate(l).unwrap()).collect();
            for (p, l) in ptrs.into_iter().zip(layouts) {
                // SAFETY: allocated above with l, freed once.
                unsafe { h.deallocate(p.cast(), l) };
            }
        }
        assert_eq!(h.stats().live_bytes, 0);
        assert!(h.stats().mapped_bytes < 256 << 20, "{:?}", h.stats());
    }
}
