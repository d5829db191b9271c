//! Explicit jemalloc thread caches, one per (thread, heap).
//!
//! A custom arena must not share jemalloc's implicit thread cache: objects of different arenas
//! would be mixed in it (see DESIGN.md, "thread-cache gotcha"). Each thread therefore gets its own
//! explicit tcache for each heap it uses, created lazily and registered with the heap, destroyed
//! at thread exit (if the heap still lives) or by the heap before its arena is destroyed. Each
//! slot also carries the thread's live-byte counter, so statistics need no shared atomics on
//! the hot path.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::error::Result;
use crate::heap::jemalloc;

/// A live-byte counter on a cache line of its own (two threads' counters must not share one).
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Counter(pub(crate) AtomicI64);

/// One thread's cache for one heap.
pub(crate) struct Slot {
    pub(crate) tcache: u32,
    pub(crate) alive: bool,
    pub(crate) live: Box<Counter>,
}

/// A heap's list of the thread caches made for it.
#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) slots: Mutex<Vec<Slot>>,
    /// Set once the heap has destroyed its caches: no new ones may be created.
    pub(crate) closed: std::sync::atomic::AtomicBool,
}

impl Registry {
    /// Sum of the live-byte counters of every slot.
    pub(crate) fn live(&self) -> i64 {
        self.slots.lock().iter().map(|s| s.live.0.load(Ordering::Acquire)).sum()
    }

    /// Destroys every cache (flushing its objects back to the arena). Called by the heap
    /// before it destroys its arena; no other thread can be using the heap then.
    pub(crate) fn destroy_all(&self) {
        self.closed.store(true, Ordering::Release);
        for s in self.slots.lock().iter_mut().filter(|s| s.alive) {
            if let Err(e) = jemalloc::tcache_destroy(s.tcache) {
                tracing::warn!("tcache.destroy({}) failed: {e}", s.tcache);
            }
            s.alive = false;
        }
    }
}

struct Entry {
    heap: u64,
    tcache: u32,
    live: *const AtomicI64,
    registry: Weak<Registry>,
}

struct ThreadCaches {
    entries: Vec<Entry>,
}

impl Drop for ThreadCaches {
    fn drop(&mut self) {
        // From here on this thread goes without caches (LAST must not point at destroyed ones).
        let _ = LAST.try_with(|c| c.set((0, 0, std::ptr::null())));
        for e in self.entries.drain(..) {
            let Some(reg) = e.registry.upgrade() else { continue };
            let mut slots = reg.slots.lock();
            if let Some(s) = slots.iter_mut().find(|s| s.tcache == e.tcache && s.alive) {
                let _ = jemalloc::tcache_destroy(s.tcache);
                s.alive = false;
            }
        }
    }
}

thread_local! {
    static CACHES: RefCell<ThreadCaches> = const { RefCell::new(ThreadCaches { entries: Vec::new() }) };
    /// The last (heap, tcache, counter) this thread used: the hot path is one TLS read.
    static LAST: Cell<(u64, u32, *const AtomicI64)> = const { Cell::new((0, 0, std::ptr::null())) };
}

/// This thread's tcache id and live counter for heap `heap`, creating them on first use.
/// `None` while the thread is exiting (its thread-locals are gone): the caller then goes
/// without a tcache.
#[inline]
pub(crate) fn get(heap: u64, registry: &Arc<Registry>) -> Option<Result<(u32, *const AtomicI64)>> {
    if let Ok((h, tc, live)) = LAST.try_with(Cell::get) {
        if h == heap {
            return Some(Ok((tc, live)));
        }
    }
    let r = get_slow(heap, registry);
    if let Some(Ok((tc, live))) = r {
        let _ = LAST.try_with(|c| c.set((heap, tc, live)));
    }
    r
}

#[cold]
fn get_slow(heap: u64, registry: &Arc<Registry>) -> Option<Result<(u32, *const AtomicI64)>> {
    CACHES
        .try_with(|c| {
            let mut c = c.try_borrow_mut().ok()?;
            if let Some(e) = c.entries.iter().find(|e| e.heap == heap) {
                return Some(Ok((e.tcache, e.live)));
            }
            Some(create(&mut c, heap, registry))
        })
        .ok()
        .flatten()
}

#[cold]
fn create(c: &mut ThreadCaches, heap: u64, registry: &Arc<Registry>) -> Result<(u32, *const AtomicI64)> {
    c.entries.retain(|e| e.registry.strong_count() > 0);
    let mut slots = registry.slots.lock();
    if registry.closed.load(Ordering::Acquire) {
        return Err(crate::Error::InvalidArgument("the heap is being dropped".into()));
    }
    let tcache = jemalloc::tcache_create()?;
    let live = Box::new(Counter::default());
    let ptr: *const AtomicI64 = &live.0;
    slots.push(Slot { tcache, alive: true, live });
    c.entries.push(Entry { heap, tcache, live: ptr, registry: Arc::downgrade(registry) });
    Ok((tcache, ptr))
}
