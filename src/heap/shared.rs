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
//! - Otherwise the heap is *draining*: a small reaper thread (started on demand, gone when
//!   nothing drains) re-sums its counters every few milliseconds and tears it down at zero.
//!   Freeing a buffer costs nothing extra, and a buffer can be freed on any thread.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::fork::{Born, ForkGuard, ForkLock};

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
        let s = Box::new(Shared {
            id: owner.id,
            born: owner.born,
            owner,
            tcaches: Arc::new(Registry::new(thread_cache)),
            arena,
            max_chunk,
            access,
            whole_chunks,
            handles: AtomicUsize::new(1),
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

    /// Drops a handle; the last one tears the heap down now, or hands it to the reaper while
    /// allocations are still live.
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
        // or the reaper (after we publish it) can do.
        if unsafe { this.as_ref() }.live() == 0 {
            // SAFETY: no handle and no allocation: nothing else can reach the record.
            unsafe { teardown(this) };
        } else {
            drain(Ptr(this));
        }
    }
}

/// Flushes the caches, destroys the arena, deregisters and unmaps every chunk, frees the record.
///
/// # Safety
/// No handle and no allocation of the heap is left, and nobody else tears it down.
unsafe fn teardown(this: NonNull<Shared>) {
    // SAFETY: the record came from Box::leak in Shared::create and is freed exactly once.
    let shared = unsafe { Box::from_raw(this.as_ptr()) };
    shared.tcaches.destroy_all();
    match jemalloc::run(&format!("arena.{}.destroy", shared.arena)) {
        Ok(()) => shared.owner.release_all(),
        Err(e) => {
            // jemalloc still uses the arena: its hooks point into the owner and its metadata lies
            // in our chunks. Keep both forever rather than leave them dangling.
            std::mem::forget(Arc::clone(&shared.owner)); // before the log (a logger may panic)
            tracing::error!("arena.{}.destroy failed ({e}); leaking the heap's registered chunks", shared.arena);
        }
    }
}

pub(crate) struct Draining {
    heaps: Vec<Ptr>,
    reaper: bool,
}

/// Process-wide; a fork()ed child finds it unlocked (see `crate::fork`).
pub(crate) static DRAINING: ForkLock<Draining> = ForkLock::new(Draining { heaps: Vec::new(), reaper: false });

/// `DRAINING`, held. In a fork()ed child the parent's draining heaps are the parent's (their
/// data is not in the child) and its reaper thread is not there: start afresh (the list, which
/// may have been mid-update at the fork, is leaked rather than freed).
fn draining_lock() -> ForkGuard<'static, Draining> {
    let mut d = DRAINING.lock();
    if d.after_fork {
        std::mem::forget(std::mem::take(&mut d.heaps));
        d.reaper = false;
    }
    d
}

/// How many heaps wait for their last allocations to be freed (for tests and stats).
pub(crate) fn draining() -> usize {
    draining_lock().heaps.len()
}

fn drain(p: Ptr) {
    let mut d = draining_lock();
    d.heaps.push(p);
    if d.reaper {
        return;
    }
    let spawned = std::thread::Builder::new().name("mralloc-heap-reaper".into()).spawn(reap);
    match spawned {
        Ok(_) => d.reaper = true,
        Err(e) => tracing::error!(
            "cannot start the heap reaper thread ({e}): heaps dropped with live buffers stay mapped \
             until another heap is dropped with live buffers"
        ),
    }
}

/// The reaper: tears down draining heaps whose last allocation is gone; exits when none is left.
fn reap() {
    let mut nap = Duration::from_millis(1);
    loop {
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(50));
        let mut done = Vec::new();
        {
            let mut d = draining_lock();
            d.heaps.retain(|p| {
                // SAFETY: a draining record lives until it leaves this list (only here).
                if unsafe { p.0.as_ref() }.live() == 0 {
                    done.push(*p);
                    false
                } else {
                    true
                }
            });
            if d.heaps.is_empty() && done.is_empty() {
                d.reaper = false;
                return;
            }
        }
        for p in done {
            nap = Duration::from_millis(1);
            // SAFETY: no handle (it was draining) and no allocation (sum zero); it left the list
            // under the lock, so no one else tears it down.
            unsafe { teardown(p.0) };
        }
    }
}
