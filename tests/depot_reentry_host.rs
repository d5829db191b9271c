//! A global allocator that serves some requests from a scoped heap (as an application may do
//! for its own collections), and poisons what it frees through the system allocator: the
//! front cache's slow paths allocate through the global allocator (a batch for the depot, a
//! magazine's slot array), which then re-enters the heap while they run. Nothing handed out
//! may come from storage the slow path freed or is changing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use allocator_api2::alloc::Allocator;
use mralloc::heap::Heap;

static HEAP: OnceLock<Heap> = OnceLock::new();
static TRACK: [AtomicUsize; 64] = [const { AtomicUsize::new(0) }; 64];
const POISON: usize = 0xA5A5_A5A5_A5A5_A5A5;

thread_local! {
    /// Allocations this thread routes to HEAP (8 KiB, align <= 8 ones).
    static ROUTE: Cell<u32> = const { Cell::new(0) };
    /// Allocations this thread made through the global allocator while counting (`None`: not
    /// counting).
    static COUNT: Cell<Option<u32>> = const { Cell::new(None) };
}

struct Router;

// SAFETY: every pointer comes from System or HEAP and goes back to the one it came from (HEAP's
// are tracked in TRACK).
unsafe impl GlobalAlloc for Router {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNT.try_with(|c| c.set(c.get().map(|n| n + 1)));
        let route = ROUTE.try_with(|r| {
            let n = r.get();
            if n > 0 && layout.size() == 8192 && layout.align() <= 8 {
                r.set(n - 1);
                true
            } else {
                false
            }
        });
        if route == Ok(true) {
            if let Some(h) = HEAP.get() {
                if let Ok(p) = h.allocate(layout) {
                    let p = p.cast::<u8>().as_ptr();
                    for t in &TRACK {
                        if t.compare_exchange(0, p as usize, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                            break;
                        }
                    }
                    return p;
                }
            }
        }
        // SAFETY: the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        for t in &TRACK {
            if t.compare_exchange(ptr as usize, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                // SAFETY: a pointer HEAP handed out for this layout (tracked above).
                unsafe { HEAP.get().unwrap().deallocate(NonNull::new_unchecked(ptr), layout) };
                return;
            }
        }
        // A debug allocator's poisoning of freed memory.
        // SAFETY: System's allocation of layout.size() bytes, being freed.
        unsafe { ptr.write_bytes(0xA5, layout.size()) };
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static A: Router = Router;

#[test]
fn a_slow_path_that_re_enters_the_heap_hands_out_nothing_stale() {
    let heap = HEAP.get_or_init(|| Heap::builder().thread_cache(1_100_000).build().unwrap());
    // 1. This thread reserves 4 KiB room it does not use (128 objects, magazine empty).
    let a: Vec<_> = (0..128).map(|_| heap.alloc(4096).unwrap()).collect();
    drop(a);
    let b: Vec<_> = (0..128).map(|_| heap.alloc(4096).unwrap()).collect();
    // 2. Its 64 B magazine at its most, full.
    let mut c: Vec<_> = (0..2049).map(|_| heap.alloc(64).unwrap()).collect();
    let last = c.pop().unwrap();
    drop(c);
    assert_eq!(heap.stats().thread_cached_bytes, 2048 * 64);
    // 3. Another thread leaves a batch of 8 KiB objects in the depot.
    std::thread::scope(|s| {
        s.spawn(|| {
            let v: Vec<_> = (0..129).map(|_| heap.alloc(8192).unwrap()).collect();
            drop(v);
        });
    });
    assert_eq!(heap.stats().depot_bytes, 64 * 8192);
    // 4. The free that halves: put's 8 KiB batch allocation is served by the heap.
    ROUTE.with(|r| r.set(1));
    drop(last);
    ROUTE.with(|r| r.set(0));
    assert_eq!(heap.stats().depot_bytes, 64 * 8192 + 1024 * 64, "the 64 B half went to the depot");
    // 5. Another thread takes the 64 B batch.
    let poisoned = std::thread::scope(|s| {
        s.spawn(|| {
            let l = Layout::from_size_align(64, 8).unwrap();
            let ps: Vec<NonNull<u8>> = (0..1024).map(|_| heap.allocate(l).unwrap().cast::<u8>()).collect();
            let bad = ps.iter().filter(|p| p.as_ptr() as usize == POISON).count();
            for p in ps.iter().filter(|p| p.as_ptr() as usize != POISON) {
                // SAFETY: allocated just above with `l`.
                unsafe { heap.deallocate(*p, l) };
            }
            bad
        })
        .join()
        .unwrap()
    });
    drop(b);
    assert_eq!(poisoned, 0, "{poisoned} objects handed out were read from freed slot storage");
}

/// A refused allocation (the heap's limit) hands the caches back and tries again without
/// allocating anything through the global allocator: one that serves from the heap would be
/// refused again, and again, inside the fallback (a flush that allocated recursed without end).
#[test]
fn a_refused_allocation_allocates_nothing() {
    let heap = Heap::builder().limit(8 << 20).build().unwrap();
    let l = Layout::from_size_align(16, 8).unwrap();
    let mut held = Vec::new();
    while let Ok(p) = heap.allocate(l) {
        held.push(p);
    }
    assert!(held.len() > 1000, "{}", held.len());
    COUNT.with(|c| c.set(Some(0)));
    let refused = heap.allocate(Layout::from_size_align(4096, 8).unwrap()).is_err();
    let made = COUNT.with(|c| c.replace(None));
    assert!(refused);
    assert_eq!(made, Some(0), "allocations made by the refusal's fallback");
    for p in held {
        // SAFETY: allocated above with `l`.
        unsafe { heap.deallocate(p.cast(), l) };
    }
}
