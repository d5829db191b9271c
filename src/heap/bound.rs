//! The lock of an owner's bound PDs as a thread sees it: a thread is marked while it waits for
//! or holds one (what teardown and, in debug builds, the global allocator check).

use std::cell::Cell;
#[cfg(all(debug_assertions, feature = "global"))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// An owner's `bound`, held: what [`lock`] (through [`crate::heap::owner::Owner::lock_bound`]) returns.
pub(crate) struct BoundGuard<'a, T>(std::sync::MutexGuard<'a, T>);

impl<T> std::ops::Deref for BoundGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for BoundGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T> Drop for BoundGuard<'_, T> {
    fn drop(&mut self) {
        HOLDING_BOUND.with(|h| h.set(h.get() - 1));
    }
}

thread_local! {
    /// How many owners' `bound` locks this thread holds or waits for (no destructor: readable
    /// until the thread is gone).
    static HOLDING_BOUND: Cell<u32> = const { Cell::new(0) };
}

/// Takes `bound` (see [`crate::heap::owner::Owner::lock_bound`]), marking the thread first.
pub(crate) fn lock<T>(bound: &Mutex<T>) -> BoundGuard<'_, T> {
    // Marked before waiting: an allocation while waiting is as bad as one while holding.
    HOLDING_BOUND.with(|h| h.set(h.get() + 1));
    BoundGuard(bound.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// Whether this thread holds, or waits for, an owner's `bound` lock — in the alloc and purge
/// hooks among others. A heap's teardown takes that lock (to deregister its chunks), so it must
/// not run then (see `heap::shared`).
pub(crate) fn holding_bound() -> bool {
    HOLDING_BOUND.with(Cell::get) > 0
}

#[cfg(all(debug_assertions, feature = "global"))]
static ALLOCS_UNDER_BOUND: AtomicU64 = AtomicU64::new(0);

/// Called by the global allocator on every allocation and free (debug builds only; compiles
/// to nothing in release).
#[cfg(feature = "global")]
#[inline(always)]
pub(crate) fn note_allocator_call() {
    #[cfg(debug_assertions)]
    if HOLDING_BOUND.with(Cell::get) > 0 {
        ALLOCS_UNDER_BOUND.fetch_add(1, Ordering::Relaxed);
    }
}

/// Allocations and frees through the global allocator made while the calling thread waited for
/// or held a heap's `bound` lock, process-wide: `Some(0)` unless a lock-order bug is back; `None` in
/// release builds, which do not count.
#[cfg(feature = "global")]
pub(crate) fn allocations_under_bound() -> Option<u64> {
    #[cfg(debug_assertions)]
    return Some(ALLOCS_UNDER_BOUND.load(Ordering::Relaxed));
    #[cfg(not(debug_assertions))]
    None
}
