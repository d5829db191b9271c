//! The front cache's slot arrays (8 bytes per object a magazine may hold, taken from the global
//! allocator) count against the thread's `thread_cache` budget: a thread that cycles through
//! every size class keeps at most its budget in objects and slots together, measured here with
//! a counting global allocator (its own test binary: the allocator counts per thread).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use mralloc::heap::Heap;

/// System's allocator, counting each thread's net bytes (allocated minus freed).
struct Counting;

thread_local! {
    static NET: Cell<isize> = const { Cell::new(0) };
}

fn add(n: isize) {
    // No destructor, const-initialised: usable inside the allocator, even at thread exit.
    let _ = NET.try_with(|c| c.set(c.get() + n));
}

// SAFETY: forwards every call to System, which upholds the contract; the counting allocates
// nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as isize);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-(layout.size() as isize));
        // SAFETY: the caller upholds `GlobalAlloc::dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        add(new_size as isize - layout.size() as isize);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The front's size classes up to 64 KiB: 8, 16, 32, 48, 64, then four per doubling.
fn class_sizes() -> Vec<usize> {
    let mut v = vec![8, 16, 32, 48, 64];
    let mut base = 64;
    while base < 64 << 10 {
        v.extend((5..=8).map(|q| q * base / 4));
        base *= 2;
    }
    v
}

#[test]
fn slot_arrays_count_against_the_thread_cache_budget() {
    const BUDGET: usize = 64 << 10;
    std::thread::spawn(|| {
        let heap = Heap::builder().thread_cache(BUDGET).build().unwrap();
        let sizes = class_sizes();
        let start = NET.with(Cell::get);
        // Per class: as many objects as a magazine could hold (1 MiB worth, at most 2048), all
        // allocated, then all freed: the class's magazine fills what the budget allows, taking
        // room back from the classes before it.
        for &size in &sizes {
            let n = ((1 << 20) / size).min(2048);
            let mut ptrs = Vec::with_capacity(n);
            let before = NET.with(Cell::get);
            for _ in 0..n {
                ptrs.push(heap.alloc(size).unwrap());
            }
            drop(ptrs);
            // The Vecs of this loop are gone again.
            assert!(NET.with(Cell::get) - before <= BUDGET as isize + (16 << 10));
        }
        let grown = (NET.with(Cell::get) - start) as usize;
        let s = heap.stats();
        assert!(s.thread_cached_bytes <= BUDGET as u64, "{}", s.thread_cached_bytes);
        // Objects live in the heap's chunks, not the global allocator: what this thread's
        // allocations grew the global allocator by is the slot arrays (and the front itself,
        // a few KiB). Without charging the slots (arrays that only grew, freed when the front
        // is), they took 38 KiB here on top of 64 KiB of objects.
        assert!(
            grown + s.thread_cached_bytes as usize <= BUDGET + (8 << 10),
            "slots {grown} B + objects {} B over a budget of {BUDGET} B",
            s.thread_cached_bytes
        );
    })
    .join()
    .unwrap();
}
