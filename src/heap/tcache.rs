//! Explicit jemalloc thread caches and front caches, one of each per (thread, heap).
//!
//! A custom arena must not share jemalloc's implicit thread cache: objects of different arenas
//! would be mixed in it (see DESIGN.md, "thread-cache gotcha"). Each thread therefore gets its own
//! explicit tcache for each heap it uses, created lazily and registered with the heap, destroyed
//! at thread exit (if the heap still lives) or by the heap before its arena is destroyed. In
//! front of it sits the thread's [`Front`] cache (size-class magazines), which lives and dies
//! with it. Each slot also carries the thread's live-byte counter, so statistics need no shared
//! atomics on the hot path.

use std::cell::{Cell, RefCell};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::error::Result;
use crate::heap::front::Front;
use crate::heap::jemalloc;

/// A thread's counters for one heap, on a cache line of their own (two threads' counters must
/// not share one). Each has one writer, the thread; anyone may read them.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Counter {
    /// Bytes handed out minus bytes freed by this thread.
    pub(crate) live: AtomicI64,
    /// Bytes kept in the thread's front cache.
    pub(crate) cached: AtomicU64,
}

/// One thread's caches for one heap.
pub(crate) struct Slot {
    pub(crate) tcache: u32,
    pub(crate) alive: bool,
    pub(crate) counter: Box<Counter>,
    /// The thread's front cache: used by that thread only, freed (with `Box::from_raw`) when
    /// the slot dies, under the registry's lock.
    front: NonNull<Front>,
}

// SAFETY: `front` is only dereferenced by its thread (while the slot is alive) or, under the
// registry's lock, by whoever kills the slot when that thread can no longer reach it.
unsafe impl Send for Slot {}

impl Slot {
    /// Returns the front cache's objects to jemalloc, destroys the tcache and frees the front.
    ///
    /// # Safety
    /// The slot is alive, its registry is locked, and its thread can no longer use the front
    /// (it is exiting, or the heap is being torn down).
    unsafe fn kill(&mut self) {
        // SAFETY: the caller's contract: nobody else references the front, which came from
        // Box::leak in `create` and is freed only here (once: `alive` goes false).
        let mut front = unsafe { Box::from_raw(self.front.as_ptr()) };
        front.flush_all();
        if let Err(e) = jemalloc::tcache_destroy(self.tcache) {
            tracing::warn!("tcache.destroy({}) failed: {e}", self.tcache);
        }
        self.alive = false;
    }
}

/// A heap's list of the thread caches made for it.
pub(crate) struct Registry {
    pub(crate) slots: Mutex<Vec<Slot>>,
    /// Set once the heap has destroyed its caches: no new ones may be created.
    pub(crate) closed: std::sync::atomic::AtomicBool,
    /// Bytes each thread's front cache may keep.
    limit: usize,
}

impl Registry {
    pub(crate) fn new(limit: usize) -> Registry {
        let limit = if crate::heap::front::classes_match_jemalloc() { limit } else { 0 };
        Registry { slots: Mutex::new(Vec::new()), closed: Default::default(), limit }
    }

    /// Sum of the live-byte counters of every slot.
    pub(crate) fn live(&self) -> i64 {
        self.slots.lock().iter().map(|s| s.counter.live.load(Ordering::Acquire)).sum()
    }

    /// Bytes kept in the front caches of every thread.
    pub(crate) fn cached(&self) -> u64 {
        self.slots.lock().iter().filter(|s| s.alive).map(|s| s.counter.cached.load(Ordering::Relaxed)).sum()
    }

    /// Destroys every cache (returning its objects to the arena). Called by the heap before it
    /// destroys its arena; no other thread can be using the heap then.
    pub(crate) fn destroy_all(&self) {
        self.closed.store(true, Ordering::Release);
        for s in self.slots.lock().iter_mut().filter(|s| s.alive) {
            // SAFETY: alive, locked, and no thread can use the heap any more.
            unsafe { s.kill() };
        }
    }
}

struct Entry {
    heap: u64,
    front: NonNull<Front>,
    registry: Weak<Registry>,
}

struct ThreadCaches {
    entries: Vec<Entry>,
}

impl Drop for ThreadCaches {
    fn drop(&mut self) {
        // From here on this thread goes without caches (LAST must not point at destroyed ones).
        let _ = LAST.try_with(|c| c.set((0, std::ptr::null_mut())));
        for e in self.entries.drain(..) {
            let Some(reg) = e.registry.upgrade() else { continue };
            let mut slots = reg.slots.lock();
            if let Some(s) = slots.iter_mut().find(|s| s.front == e.front && s.alive) {
                // SAFETY: alive, locked, and this thread (the front's) is exiting: nothing of it
                // uses the front after this.
                unsafe { s.kill() };
            }
        }
    }
}

thread_local! {
    static CACHES: RefCell<ThreadCaches> = const { RefCell::new(ThreadCaches { entries: Vec::new() }) };
    /// The last (heap, front cache) this thread used: the hot path is one TLS read.
    static LAST: Cell<(u64, *mut Front)> = const { Cell::new((0, std::ptr::null_mut())) };
}

/// This thread's front cache for heap `heap` (which holds its tcache and counters), created on
/// first use. `None` while the thread is exiting (its thread-locals are gone): the caller then
/// goes without caches. The front is valid until this thread exits or the heap is torn down.
#[inline]
pub(crate) fn get(heap: u64, registry: &Arc<Registry>) -> Option<Result<NonNull<Front>>> {
    if let Ok((h, front)) = LAST.try_with(Cell::get) {
        if h == heap {
            if let Some(f) = NonNull::new(front) {
                return Some(Ok(f));
            }
        }
    }
    let r = get_slow(heap, registry);
    if let Some(Ok(f)) = r {
        let _ = LAST.try_with(|c| c.set((heap, f.as_ptr())));
    }
    r
}

#[cold]
fn get_slow(heap: u64, registry: &Arc<Registry>) -> Option<Result<NonNull<Front>>> {
    CACHES
        .try_with(|c| {
            let mut c = c.try_borrow_mut().ok()?;
            if let Some(e) = c.entries.iter().find(|e| e.heap == heap) {
                return Some(Ok(e.front));
            }
            Some(create(&mut c, heap, registry))
        })
        .ok()
        .flatten()
}

#[cold]
fn create(c: &mut ThreadCaches, heap: u64, registry: &Arc<Registry>) -> Result<NonNull<Front>> {
    c.entries.retain(|e| e.registry.strong_count() > 0);
    let mut slots = registry.slots.lock();
    if registry.closed.load(Ordering::Acquire) {
        return Err(crate::Error::InvalidArgument("the heap is being dropped".into()));
    }
    let tcache = jemalloc::tcache_create()?;
    let counter = Box::new(Counter::default());
    let front = NonNull::from(Box::leak(Box::new(Front::new(tcache, &counter, registry.limit))));
    slots.push(Slot { tcache, alive: true, counter, front });
    c.entries.push(Entry { heap, front, registry: Arc::downgrade(registry) });
    Ok(front)
}
