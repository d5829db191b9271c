//! The state a scoped heap's handles and buffers share, and when it is torn down.
//!
//! A [`crate::heap::Heap`] is a cheap handle; [`crate::heap::Buffer`]s carry no lifetime. Both
//! point at one [`Shared`] record: the arena, its hooks' owner, its thread caches. The record,
//! the arena and every registered chunk stay until the last handle *and* the last allocation
//! are gone.
//!
//! Handles are counted with an atomic (cloning a handle is rare). Allocations are not: that
//! would put a shared read-modify-write on every allocation. They are counted in bytes, per
//! thread, by the live-byte counters the heap keeps anyway (one writer each, a plain store). The
//! decision to tear down is taken once no handle is left, so no allocation can happen any more:
//! from then on every counter only goes down, and a sum of counters read one after the other is
//! never below the true total at the end of the reads. A sum of zero therefore proves that every
//! allocation was freed (and, through the counters' release stores, that the frees are done).
//!
//! - The thread that drops the last handle sums the counters: zero means it tears down at once
//!   (the common case: buffers freed before the heap).
//! - Otherwise the heap is *draining*: it joins the process's draining list, and its
//!   [`Gate`] closes, so that the frees of its buffers ([`crate::heap::Buffer`]'s drop, the only
//!   free without a handle) leave their common path — which stays as it was: the gate is the
//!   fork-generation check that path makes anyway. After such a free (its counter store done)
//!   the freeing thread sums the counters again and tears the heap down at zero: the last
//!   free does it, on whichever thread it happens. Dropping a heap's last handle and building
//!   a heap look at every draining heap too.
//! - Where the freeing thread may not tear down — it holds (or waits for) a heap's `bound`
//!   lock, which teardown takes ([`crate::heap::bound::holding_bound`]: the extent hooks among
//!   others), or it is unwinding from a panic (a panic in teardown would abort) — it leaves the
//!   work to the process's liveness thread ([`crate::verbs::liveness::defer`]), which starts
//!   (if it was not running) when a heap starts draining and looks at the draining heaps while
//!   any is left: at its next round when woken by such a free, and at the latest every
//!   [`crate::verbs::liveness::MOST_PAUSE`] (1 s). That also catches a free that passed the
//!   gate just before it closed (it sees the gate open, and takes the common path).
//!
//! The extent hooks and the global allocator run no code that frees a scoped heap's buffer;
//! the free path's own locks (a thread cache's) are released before the sum.
//!
//! Teardown happens once: a draining heap leaves the list under the list's lock, by the thread
//! that then tears it down; one that never joined it is torn down by the thread that dropped
//! its last handle, when nothing else can reach it.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::fork::{Born, ForkGuard, ForkLock, Gate};

use crate::heap::jemalloc;
use crate::heap::owner::Owner;
use crate::heap::tcache::Registry;
use crate::verbs::Access;

/// What a heap's handles and buffers point at.
pub(crate) struct Shared {
    pub(crate) id: u64,
    /// The owner's: a fork()ed child leaves the heap alone (see `crate::fork`).
    pub(crate) born: Born,
    pub(crate) owner: Arc<Owner>,
    pub(crate) tcaches: Arc<Registry>,
    pub(crate) arena: u32,
    pub(crate) max_chunk: usize,
    /// The rights the heap was built with: its buffers are exposed with the remote part.
    pub(crate) access: Access,
    /// Whether chunks are registered with the remote rights too (chunk-wide rkeys).
    pub(crate) whole_chunks: bool,
    /// Live [`crate::heap::Heap`] handles. Once it reaches zero it never rises again.
    handles: AtomicUsize,
    /// Open (at `born`) until the heap drains: a free that finds it closed takes the draining
    /// path (see the module docs).
    frees: Gate,
}

/// A `Shared` pointer that may cross threads (it is only dereferenced while the heap lives).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ptr(NonNull<Shared>);
// SAFETY: Shared is Sync (atomics, Arcs of Sync types, plain integers); the pointer is only
// dereferenced while the record is alive (see the module docs).
unsafe impl Send for Ptr {}

impl Shared {
    /// A record with one handle.
    pub(crate) fn create(
        owner: Arc<Owner>,
        arena: u32,
        max_chunk: usize,
        access: Access,
        whole_chunks: bool,
        thread_cache: usize,
    ) -> NonNull<Shared> {
        let born = owner.born;
        let s = Box::new(Shared {
            id: owner.id,
            born,
            owner,
            tcaches: Arc::new(Registry::new(thread_cache)),
            arena,
            max_chunk,
            access,
            whole_chunks,
            handles: AtomicUsize::new(1),
            frees: Gate::open(born),
        });
        NonNull::from(Box::leak(s))
    }

    /// Bytes allocated and not freed, over every thread. Exact once no handle is left;
    /// otherwise a snapshot.
    pub(crate) fn live(&self) -> i64 {
        self.tcaches.live() + self.owner.counters.orphan_live.load(Ordering::Acquire)
    }

    /// The heap's id.
    #[inline(always)]
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The fork generation the heap was made in.
    #[inline(always)]
    pub(crate) fn born(&self) -> Born {
        self.born
    }

    /// Whether a free of the heap's allocations takes the common path: the heap is not
    /// draining, and this is the process that made it. Otherwise the caller tells a fork()ed
    /// child ([`Shared::born`]) from a draining heap, whose frees end in
    /// [`after_draining_free`].
    #[inline(always)]
    pub(crate) fn frees_common(&self) -> bool {
        self.frees.here()
    }

    /// The heap's per-thread caches.
    #[inline(always)]
    pub(crate) fn registry(&self) -> &Arc<Registry> {
        &self.tcaches
    }

    /// Live bytes of the threads that have no front cache (several writers).
    #[inline(always)]
    pub(crate) fn orphan_live(&self) -> &std::sync::atomic::AtomicI64 {
        &self.owner.counters.orphan_live
    }

    /// A new handle (the caller holds one, so the count is above zero).
    pub(crate) fn acquire(&self) {
        self.handles.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops a handle; the last one tears the heap down now, or makes it drain while
    /// allocations are still live (and looks at the other draining heaps).
    ///
    /// # Safety
    /// `this` is a live record and the caller gives up one handle it holds.
    pub(crate) unsafe fn release(this: NonNull<Shared>) {
        // SAFETY: the caller's handle keeps the record alive until this decrement.
        if unsafe { this.as_ref() }.handles.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        // Every other handle's allocations (and their counter stores) happen-before this.
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: no handle is left; the record lives until torn down, which only this thread
        // or one that finds it on the draining list (after we put it there) can do.
        if unsafe { this.as_ref() }.live() == 0 {
            // SAFETY: no handle and no allocation: nothing else can reach the record.
            unsafe { teardown(this) };
        } else {
            drain(Ptr(this));
        }
        reap_draining();
    }
}

/// Flushes the caches, destroys the arena, deregisters and unmaps every chunk, frees the record.
///
/// # Safety
/// No handle and no allocation of the heap is left, and nobody else tears it down.
unsafe fn teardown(this: NonNull<Shared>) {
    // SAFETY: the record came from Box::leak in Shared::create and is freed exactly once.
    let shared = unsafe { Box::from_raw(this.as_ptr()) };
    // The arena's hooks point into the owner until it is destroyed: should anything below
    // unwind first, the owner (and its chunks) is leaked, never freed under jemalloc.
    let keep = std::mem::ManuallyDrop::new(Arc::clone(&shared.owner));
    shared.tcaches.destroy_all();
    // Teardown may run in any buffer's drop — also a thread-local's destructor at thread exit,
    // where a subscriber that uses its own thread-locals panics, and a panic there aborts: the
    // logs are contained.
    let log = |f: &dyn Fn()| drop(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    match jemalloc::run(&format!("arena.{}.destroy", shared.arena)) {
        Ok(()) => {
            drop(std::mem::ManuallyDrop::into_inner(keep));
            shared.owner.release_all();
            log(&|| tracing::debug!(heap = shared.id, arena = shared.arena, "heap torn down"));
        }
        Err(e) => {
            // jemalloc still uses the arena: its hooks point into the owner and its metadata lies
            // in our chunks. Keep both forever (`keep` is never dropped) rather than leave them
            // dangling.
            log(&|| {
                tracing::error!("arena.{}.destroy failed ({e}); leaking the heap's registered chunks", shared.arena)
            });
        }
    }
}

/// The heaps that wait for their last allocations to be freed (no handle is left to any).
pub(crate) struct Draining {
    heaps: Vec<Ptr>,
}

/// Process-wide; a fork()ed child finds it unlocked (see `crate::fork`).
pub(crate) static DRAINING: ForkLock<Draining> = ForkLock::new(Draining { heaps: Vec::new() });

/// `DRAINING`, held. In a fork()ed child the parent's draining heaps are the parent's (their
/// data is not in the child, and no free of theirs happens there): start afresh (the list,
/// which may have been mid-update at the fork, is leaked rather than freed).
fn draining_lock() -> ForkGuard<'static, Draining> {
    let mut d = DRAINING.lock();
    if d.after_fork {
        std::mem::forget(std::mem::take(&mut d.heaps));
    }
    d
}

/// How many heaps wait for their last allocations to be freed (for tests and stats).
pub(crate) fn draining() -> usize {
    draining_lock().heaps.len()
}

/// Makes a heap with no handle and live allocations drain: the liveness thread is set to look
/// at it, its frees leave their common path, and it joins the list. The caller then looks at
/// the list ([`reap_draining`]): the heap's last allocation may have gone meanwhile, through a
/// free that found the gate closed but the heap not yet listed.
fn drain(p: Ptr) {
    // First: a free that may not tear down relies on it (and only wakes it: no allocation).
    // Contained: a heap may be dropped in a thread-local's destructor, where a logging
    // subscriber may panic (and a panic there aborts).
    let started = std::panic::catch_unwind(crate::verbs::removal::monitor);
    match started {
        Ok(Ok(_)) => crate::verbs::liveness::defer(reap_draining),
        Ok(Err(e)) => drop(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tracing::error!(
                "cannot start the liveness thread ({e}): a heap dropped while buffers of it live is torn \
                 down by the free of its last buffer, or when a heap is built or dropped later"
            )
        }))),
        Err(payload) => std::mem::forget(payload),
    }
    // SAFETY: not torn down before it is listed (only this thread can reach it until then).
    unsafe { p.0.as_ref() }.frees.close();
    draining_lock().heaps.push(p);
}

/// After the free of a draining heap's allocation (`heap` may be gone: it is only compared with
/// the list's entries): tears the heap down if that was its last allocation, or has the
/// liveness thread look where this thread may not do that (see the module docs).
pub(crate) fn after_draining_free(heap: NonNull<Shared>) {
    if std::thread::panicking() || crate::heap::bound::holding_bound() {
        crate::verbs::liveness::defer(reap_draining);
    } else {
        reap(Some(Ptr(heap)));
    }
}

/// Tears down the draining heaps whose last allocation is gone; returns whether draining heaps
/// are left. Run when a heap is built or its last handle dropped, and as the liveness thread's
/// deferred work while heaps drain.
pub(crate) fn reap_draining() -> bool {
    reap(None)
}

/// Tears down the draining heaps (`only` that one, if it is listed) whose allocations are all
/// freed; returns whether draining heaps are left.
fn reap(only: Option<Ptr>) -> bool {
    let mut done = Vec::new();
    let left = {
        let mut d = draining_lock();
        d.heaps.retain(|p| {
            // SAFETY: a listed record lives until it leaves the list (only here, under the lock).
            if only.is_some_and(|o| o != *p) || unsafe { p.0.as_ref() }.live() != 0 {
                return true;
            }
            done.push(*p);
            false
        });
        !d.heaps.is_empty()
    };
    for p in done {
        // SAFETY: no handle (it was draining) and no allocation (sum zero); it left the list
        // under the lock, so no one else tears it down.
        unsafe { teardown(p.0) };
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::chunk;
    use std::time::{Duration, Instant};

    /// A buffer dropped while its thread unwinds from a panic does not tear its drained heap
    /// down there; the liveness thread does, soon after. The draining list is held meanwhile
    /// (by another thread, for 5 s at most: printing the panic may take a while), so that the
    /// liveness thread cannot get there first; a drop that tore down itself would wait for it
    /// and find the chunks gone.
    #[test]
    fn a_free_while_unwinding_leaves_teardown_to_the_liveness_thread() {
        let heap = crate::heap::Heap::builder().build().unwrap();
        let buf = heap.alloc(4096).unwrap();
        let (id, addr) = (heap.id(), buf.addr() as usize);
        drop(heap);
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let list = DRAINING.lock();
            held_tx.send(()).unwrap();
            let _ = go_rx.recv_timeout(Duration::from_secs(5));
            drop(list);
        });
        held_rx.recv().unwrap();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _dropped_while_unwinding = buf;
            panic!("unwinding drops the buffer");
        }));
        assert!(unwound.is_err());
        let mapped = chunk::find(addr).is_some_and(|(_, r)| r.owner.load(Ordering::Relaxed) == id);
        let _ = go_tx.send(());
        holder.join().unwrap();
        assert!(mapped, "the heap was torn down by a drop during unwinding");
        let start = Instant::now();
        while chunk::owned_by(id).next().is_some() {
            assert!(start.elapsed() < Duration::from_secs(5), "the liveness thread did not tear the heap down");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
