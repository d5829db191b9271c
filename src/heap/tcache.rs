//! Explicit jemalloc thread caches and front caches, one of each per (thread, heap).
//!
//! A custom arena must not share jemalloc's implicit thread cache: objects of different arenas
//! would be mixed in it (a `mallocx` with `MALLOCX_ARENA` but the implicit tcache hands out
//! whatever the tcache holds, from any arena, and a free puts an object of this arena where
//! another arena's allocation may take it). Each thread therefore gets its own
//! explicit tcache for each heap it uses, created lazily and registered with the heap, destroyed
//! at thread exit (if the heap still lives) or by the heap before its arena is destroyed. In
//! front of it sits the thread's [`Front`] cache (size-class magazines), which lives and dies
//! with it and also counts the thread's live bytes, so statistics need no shared atomics on the
//! hot path.

use std::cell::{Cell, RefCell};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::fork::Born;

use crate::error::Result;
use crate::heap::depot::Depot;
use crate::heap::front::Front;
use crate::heap::jemalloc;

/// One thread's caches for one heap.
pub(crate) struct Slot {
    pub(crate) alive: bool,
    /// The thread's front cache (which holds its tcache): used by that thread only (other
    /// threads read its counters under the registry's lock), freed (with `Box::from_raw`) when the slot dies, under that
    /// lock.
    front: NonNull<Front>,
}

// SAFETY: `front` is only changed by its thread (while the slot is alive); other threads read
// its atomic counters, or kill the slot when that thread can no longer reach it, only under the
// registry's lock.
unsafe impl Send for Slot {}

impl Slot {
    /// Returns the front cache's objects to jemalloc, destroys the tcache and frees the front,
    /// adding its live bytes to `retired`.
    ///
    /// # Safety
    /// The slot is alive, its registry is locked, and its thread can no longer use the front
    /// (it is exiting, or the heap is being torn down).
    unsafe fn kill(&mut self, retired: &AtomicI64) {
        // SAFETY: the caller's contract: nobody else references the front, which came from
        // Box::leak in `create` and is freed only here (once: `alive` goes false).
        let front = unsafe { Box::from_raw(self.front.as_ptr()) };
        front.flush_all();
        retired.fetch_add(front.live(), Ordering::AcqRel);
        if let Err(e) = jemalloc::tcache_destroy(front.tcache) {
            tracing::warn!("tcache.destroy({}) failed: {e}", front.tcache);
        }
        self.alive = false;
    }
}

/// A heap's list of the thread caches made for it.
pub(crate) struct Registry {
    pub(crate) slots: Mutex<Vec<Slot>>,
    /// Set once the heap has destroyed its caches: no new ones may be created.
    pub(crate) closed: std::sync::atomic::AtomicBool,
    /// Live bytes of the fronts that are gone (their threads exited).
    retired: AtomicI64,
    /// Bytes each thread's front cache may keep (and the depot).
    limit: usize,
    /// Batches of free objects the fronts hand each other (see `heap::depot`).
    depot: Depot,
    /// A fork()ed child leaves a parent heap's caches alone (its lock may be held).
    born: Born,
}

impl Registry {
    pub(crate) fn new(limit: usize) -> Registry {
        crate::heap::classes::check_classes_once();
        Registry {
            slots: Mutex::new(Vec::new()),
            closed: Default::default(),
            retired: AtomicI64::new(0),
            limit,
            depot: Depot::new(limit),
            born: Born::now(),
        }
    }

    /// The heap's depot.
    pub(crate) fn depot(&self) -> &Depot {
        &self.depot
    }

    /// Live bytes over every thread that used the heap.
    pub(crate) fn live(&self) -> i64 {
        Self::live_in(&self.slots.lock()) + self.retired.load(Ordering::Acquire)
    }

    /// `(live, cached, depot)`: live bytes as [`Registry::live`], bytes kept in the front
    /// caches of every thread, and bytes kept in the depot.
    pub(crate) fn live_and_cached(&self) -> (i64, u64, u64) {
        self.snapshot(&self.slots.lock())
    }

    /// As [`Registry::live_and_cached`] if the lock is free now, without waiting (a fork()ed
    /// child: a parent thread may have held it at the fork).
    pub(crate) fn try_live_and_cached(&self) -> Option<(i64, u64, u64)> {
        Some(self.snapshot(&self.slots.try_lock()?))
    }

    fn snapshot(&self, slots: &[Slot]) -> (i64, u64, u64) {
        let live = Self::live_in(slots) + self.retired.load(Ordering::Acquire);
        (live, Self::cached_in(slots), self.depot.bytes() as u64)
    }

    fn live_in(slots: &[Slot]) -> i64 {
        // SAFETY: an alive slot's front is freed only under the lock the caller holds.
        slots.iter().filter(|s| s.alive).map(|s| unsafe { s.front.as_ref() }.live()).sum()
    }

    fn cached_in(slots: &[Slot]) -> u64 {
        // SAFETY: as in `live_in`.
        slots.iter().filter(|s| s.alive).map(|s| unsafe { s.front.as_ref() }.cached() as u64).sum()
    }

    /// Destroys every cache (returning its objects to the arena). Called by the heap before it
    /// destroys its arena; no other thread can be using the heap then.
    pub(crate) fn destroy_all(&self) {
        self.closed.store(true, Ordering::Release);
        for s in self.slots.lock().iter_mut().filter(|s| s.alive) {
            // SAFETY: alive, locked, and no thread can use the heap any more.
            unsafe { s.kill(&self.retired) };
        }
        // The depot's objects are left where they are: the arena's destruction, next,
        // discards them with everything else it holds.
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
            if !reg.born.here() {
                std::mem::forget(reg); // a parent heap's, in a fork()ed child
                continue;
            }
            let mut slots = reg.slots.lock();
            if let Some(s) = slots.iter_mut().find(|s| s.front == e.front && s.alive) {
                // SAFETY: alive, locked, and this thread (the front's) is exiting: nothing of it
                // uses the front after this.
                unsafe { s.kill(&reg.retired) };
            }
            if !slots.iter().any(|s| s.alive) && !reg.closed.load(Ordering::Acquire) {
                // No thread uses the heap's caches any more: nobody would take what the depot
                // keeps, which returns to the heap as the threads' caches did. Under the lock,
                // and only while the heap is open: its teardown closes it, then takes this lock
                // before it destroys the arena. (Up to a budget's worth of frees to jemalloc,
                // during which statistics and new threads' caches wait for the lock.)
                reg.depot.flush();
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
/// first use. `None` while the thread is exiting (its thread-locals are gone), in a fork()ed
/// child of the process that made the heap, or if the caches could not be made (the heap is
/// being dropped, or jemalloc has no tcache left): the caller then goes without. The front is
/// valid until this thread exits or the heap is torn down.
#[inline(always)]
pub(crate) fn get(heap: u64, registry: &Arc<Registry>) -> Option<NonNull<Front>> {
    last(heap).or_else(|| get_slow(heap, registry))
}

/// This thread's front cache for heap `heap` if it is the one this thread used last (one
/// thread-local read): the fast path's lookup. `None` does not mean there is none: ask [`get`].
/// Never a front of the parent's in a fork()ed child (see [`forget_in_child`]).
#[inline(always)]
pub(crate) fn last(heap: u64) -> Option<NonNull<Front>> {
    let (h, front) = LAST.try_with(Cell::get).ok()?;
    // SAFETY: LAST holds either (0, null) or a heap's id (ids start at 1) with a non-null front
    // of this thread's for it (see `get_slow`, `ThreadCaches::drop`, `forget_in_child`). After
    // that heap's teardown the front may be freed while LAST still names its id; ids are never
    // reused (NEXT_OWNER_ID) and no handle or allocation of a torn-down heap exists, so no
    // caller asks for that id again and the stale pointer is never returned.
    (h == heap).then(|| unsafe { NonNull::new_unchecked(front) })
}

/// This thread's front cache for heap `heap` if it has one (none is made).
pub(crate) fn existing(heap: u64, registry: &Arc<Registry>) -> Option<NonNull<Front>> {
    if !registry.born.here() {
        return None; // a parent's heap in a fork()ed child: its fronts are the parent's
    }
    last(heap).or_else(|| {
        CACHES
            .try_with(|c| c.try_borrow().ok()?.entries.iter().find(|e| e.heap == heap).map(|e| e.front))
            .ok()
            .flatten()
    })
}

/// In a fork()ed child (its only thread is the one that forked): the fast path must not find
/// the parent's fronts, which serve the parent's heaps; every later lookup takes the slow path,
/// which refuses them. Called by the fork handler: no allocation, no lock.
pub(crate) fn forget_in_child() {
    let _ = LAST.try_with(|c| c.set((0, std::ptr::null_mut())));
}

#[cold]
#[inline(never)]
fn get_slow(heap: u64, registry: &Arc<Registry>) -> Option<NonNull<Front>> {
    if !registry.born.here() {
        return None; // a parent's heap in a fork()ed child: its fronts are the parent's
    }
    let f = CACHES
        .try_with(|c| {
            let mut c = c.try_borrow_mut().ok()?;
            if let Some(e) = c.entries.iter().find(|e| e.heap == heap) {
                return Some(e.front);
            }
            create(&mut c, heap, registry).inspect_err(|e| tracing::debug!("no thread cache for heap {heap}: {e}")).ok()
        })
        .ok()
        .flatten()?;
    let _ = LAST.try_with(|c| c.set((heap, f.as_ptr())));
    Some(f)
}

#[cold]
fn create(c: &mut ThreadCaches, heap: u64, registry: &Arc<Registry>) -> Result<NonNull<Front>> {
    c.entries.retain(|e| e.registry.strong_count() > 0);
    let mut slots = registry.slots.lock();
    if registry.closed.load(Ordering::Acquire) {
        return Err(crate::Error::InvalidArgument("the heap is being dropped".into()));
    }
    // Slots of threads that exited are dropped here, so that a heap outliving many threads
    // keeps one slot per live thread (their live bytes went to `retired` when they died).
    slots.retain(|s| s.alive);
    let tcache = jemalloc::tcache_create()?;
    // The registry (an Arc the heap holds) outlives the front, which dies in `destroy_all` at
    // the latest: the depot's address is stable and valid for the front's life.
    let depot = NonNull::from(&registry.depot);
    let front = NonNull::from(Box::leak(Box::new(Front::new(tcache, registry.limit, depot))));
    slots.push(Slot { alive: true, front });
    c.entries.push(Entry { heap, front, registry: Arc::downgrade(registry) });
    Ok(front)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry outliving many threads keeps a slot per live thread, not one per thread ever.
    #[test]
    fn exited_threads_leave_no_slot() {
        let reg = Arc::new(Registry::new(1 << 20));
        // An id no heap has (ids count up from 1); only these threads use it.
        let id = u64::MAX - 7;
        for _ in 0..20 {
            let r = Arc::clone(&reg);
            std::thread::spawn(move || assert!(get(id, &r).is_some())).join().unwrap();
        }
        let r = Arc::clone(&reg);
        let (made, done) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            s.spawn(|| {
                assert!(get(id, &r).is_some());
                made.wait();
                done.wait();
            });
            made.wait();
            let slots = reg.slots.lock().len();
            done.wait();
            assert_eq!(slots, 1, "the live thread's only: dead slots were dropped");
        });
        reg.destroy_all();
    }
}
