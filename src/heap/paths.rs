//! The scoped heap's allocation and free paths: the front cache's fast path (a small class on
//! the thread's last front: one table load, one magazine store, the live counter), the front for
//! any layout, and the arena (through the thread's jemalloc tcache) behind both.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use tikv_jemalloc_sys as je;

use crate::error::Result;
use crate::heap::classes::{alloc_size, cacheable_class, small_class};
use crate::heap::depot::Depot;
use crate::heap::front::{add_live, Front};
use crate::heap::hook_error::{discard_hook_error, take_hook_error, HookError};
use crate::heap::jemalloc;
use crate::heap::pagemap::SLOT;
use crate::heap::scoped::Heap;
use crate::heap::shared::{after_draining_free, Shared};
use crate::heap::tcache;

/// An object for `layout` (size > 0) from this thread's front cache on the fast path
/// ([`take_small`]), zeroed if asked; `None`: ask [`alloc_any`].
#[inline(always)]
pub(crate) fn take_cached(heap: &Heap, layout: Layout, zeroed: bool) -> Option<NonNull<u8>> {
    let p = take_small(heap, layout)?;
    if zeroed {
        // SAFETY: a kept object of a class of at least layout.size() bytes, ours now.
        unsafe { p.as_ptr().write_bytes(0, layout.size()) };
    }
    Some(p)
}

/// The fast path of [`take_cached`]: a layout [`small_class`] knows, on a thread whose
/// last front is this heap's. `None` does not mean the front has nothing: ask
/// [`alloc_any`]. (No fork-generation check: a fork()ed child's fast path finds no
/// front.)
#[inline(always)]
pub(crate) fn take_small(heap: &Heap, layout: Layout) -> Option<NonNull<u8>> {
    let class = small_class(layout)?;
    // SAFETY: this thread's front for this heap, which lives while we hold a handle.
    let f = unsafe { tcache::last(heap.id())?.as_ref() };
    let p = f.take(class)?;
    // SAFETY: this thread's counter for this heap, which our handle keeps alive.
    unsafe { add_live(f.live_counter(), layout.size() as i64) };
    Some(p)
}

/// [`Heap::raw_alloc`] past the fast path, for any layout (size > 0): this thread's front
/// (created if needed) for the layout's class, a batch from the heap's depot, else the arena
/// (through the thread's tcache). The caller has checked the fork generation.
#[inline(never)]
pub(crate) fn alloc_any(heap: &Heap, layout: Layout, zeroed: bool) -> Result<NonNull<u8>> {
    let size = layout.size();
    let align = jemalloc::align_flags(layout);
    let fp = front(heap.id(), heap.shared_ptr());
    // SAFETY (every `as_ref` of `fp`): this thread's front for this heap, which lives while
    // we hold a handle.
    let f = fp.map(|f| unsafe { f.as_ref() });
    if let (Some(f), Some(class)) = (f, cacheable_class(size, align)) {
        if let Some(p) = f.take(class).or_else(|| f.refill(class)) {
            // SAFETY: this thread's counter for the heap, which our handle keeps alive.
            unsafe { add_live(f.live_counter(), size as i64) };
            if zeroed {
                // SAFETY: a kept object of a class of at least `size` bytes, ours now.
                unsafe { p.as_ptr().write_bytes(0, size) };
            }
            return Ok(p);
        }
    }
    // The thread's tcache, or none while the thread has no front (it is exiting).
    let tc = f.map_or(je::MALLOCX_TCACHE_NONE, |f| f.tcache_flag);
    // A size a front could keep is allocated as its class, with or without a front here (so
    // that it can be kept when freed, on any thread).
    let n = alloc_size(size, align);
    let mut flags = je::MALLOCX_ARENA(heap.arena_index() as usize) | tc | align;
    // A zeroed request with 2 MiB alignment would reach the alloc hook with exactly the
    // arguments of jemalloc's metadata requests (see hooks.rs): zero those in Rust instead.
    let zero_here = zeroed && layout.align() >= SLOT;
    if zeroed && !zero_here {
        flags |= je::MALLOCX_ZERO;
    }
    // SAFETY: n >= size > 0 (checked by callers); flags name our arena and a tcache of ours
    // (or none); fp is this thread's front.
    let p = unsafe { mallocx_or_flush(fp, heap.shared().registry().depot(), n, flags) };
    crate::heap::events::emit_pending();
    let p = p.map_err(|e| e.into_error(size))?;
    if zero_here {
        // SAFETY: a fresh allocation of layout.size() bytes.
        unsafe { p.as_ptr().write_bytes(0, size) };
    }
    match f {
        // SAFETY: this thread's counter for the heap, which our handle keeps alive.
        Some(f) => unsafe { add_live(f.live_counter(), size as i64) },
        // Without a front the counter is the shared fallback (several writers).
        None => {
            heap.shared().orphan_live().fetch_add(size as i64, Ordering::AcqRel);
        }
    }
    Ok(p)
}

/// `mallocx(size, flags)`; if jemalloc fails (the heap's limit or the device refused a new
/// chunk), this thread's kept objects (`front`) and the heap's depot go back to the arena
/// first and it tries once more: freed memory parked in the caches must not make an allocation
/// fail. Returns the hook's error otherwise.
///
/// # Safety
/// As `mallocx`: size > 0 and flags name the heap's arena and a tcache of this thread's for it;
/// `front` is this thread's front for the heap, not referenced elsewhere during the call;
/// `depot` is the heap's.
pub(crate) unsafe fn mallocx_or_flush(
    front: Option<NonNull<Front>>,
    depot: &Depot,
    size: usize,
    flags: libc::c_int,
) -> std::result::Result<NonNull<u8>, HookError> {
    // SAFETY: the caller's contract.
    if let Some(p) = NonNull::new(unsafe { je::mallocx(size, flags) }.cast::<u8>()) {
        // A hook may have failed on the way (jemalloc then fell back): not this call's error,
        // nor a later one's.
        discard_hook_error();
        return Ok(p);
    }
    let first = take_hook_error();
    if let Some(fp) = front {
        // SAFETY: the caller's contract: this thread's front for the heap, alive during the call.
        unsafe { fp.as_ref() }.flush_to_arena();
    } else if depot.bytes() == 0 {
        return Err(first);
    }
    depot.flush();
    // SAFETY: the caller's contract.
    match NonNull::new(unsafe { je::mallocx(size, flags) }.cast::<u8>()) {
        Some(p) => {
            discard_hook_error();
            Ok(p)
        }
        None => match take_hook_error() {
            HookError::None => Err(first),
            again => Err(again),
        },
    }
}

/// This thread's front cache for the heap; `None` while the thread exits (or if its caches
/// could not be made): the caller then goes without, through the shared counter.
#[inline(always)]
fn front(id: u64, shared: NonNull<Shared>) -> Option<NonNull<Front>> {
    // SAFETY: callers hold a handle or a live allocation, so the record lives; the reference
    // ends before the allocation is freed (see free_raw).
    tcache::get(id, unsafe { shared.as_ref() }.registry())
}

/// Frees memory from [`Heap::raw_alloc`]. After the live counter's store (the last thing it
/// does) the heap may be torn down by another thread: nothing of it is touched after that.
/// `common` is what [`Shared::frees_common`] said (read once by the caller, which needs it
/// too): a free that read it just before the heap began to drain takes the common path, which
/// the heap's teardown allows for (see `heap::shared`).
///
/// # Safety
/// `ptr` must come from `raw_alloc(layout)` on the heap behind `shared` and not have been freed.
#[inline]
pub(crate) unsafe fn free_raw(shared: NonNull<Shared>, ptr: NonNull<u8>, layout: Layout, common: bool) {
    // SAFETY: the allocation being freed keeps the record alive up to the counter store.
    let id = unsafe { shared.as_ref().id() };
    if !common {
        // SAFETY: forwarded contract.
        return unsafe { free_uncommon(shared, ptr, layout) };
    }
    // SAFETY: forwarded contract; `id` is the record's.
    unsafe { free_in(id, shared, ptr, layout) }
}

/// [`free_raw`] off its common path: a parent's allocation in a fork()ed child (the parent's
/// to free: nothing is done), or one of a draining heap, freed as usual, after which the heap
/// may be torn down ([`after_draining_free`]).
///
/// # Safety
/// As [`free_raw`].
#[cold]
#[inline(never)]
unsafe fn free_uncommon(shared: NonNull<Shared>, ptr: NonNull<u8>, layout: Layout) {
    // SAFETY: the allocation being freed keeps the record alive up to the counter store.
    let (id, born) = unsafe { (shared.as_ref().id(), shared.as_ref().born()) };
    if !born.here() {
        return;
    }
    // SAFETY: forwarded contract; `id` is the record's.
    unsafe { free_in(id, shared, ptr, layout) };
    // The record may be gone now: only its address goes on.
    after_draining_free(shared);
}

/// [`free_raw`] with the heap's id already at hand (a handle carries a copy).
///
/// # Safety
/// As [`free_raw`], and `id` is the id of the record behind `shared`.
#[inline(always)]
unsafe fn free_in(id: u64, shared: NonNull<Shared>, ptr: NonNull<u8>, layout: Layout) {
    // SAFETY: forwarded.
    if !unsafe { free_small(id, shared, ptr, layout) } {
        // SAFETY: forwarded.
        unsafe { free_any(id, shared, ptr, layout) }
    }
}

/// The fast path of [`free_in`]: a layout [`small_class`] knows, on a thread whose last front
/// is this heap's; `false` (nothing done) for any other. (No fork-generation check: a fork()ed
/// child's fast path finds no front.)
///
/// # Safety
/// As [`free_in`].
#[inline(always)]
pub(crate) unsafe fn free_small(id: u64, shared: NonNull<Shared>, ptr: NonNull<u8>, layout: Layout) -> bool {
    let Some(class) = small_class(layout) else { return false };
    let Some(fp) = tcache::last(id) else { return false };
    // SAFETY: this thread's front for this heap, alive while the allocation being freed is;
    // the reference is not used after the counter store (after which the heap may be torn
    // down).
    let f = unsafe { fp.as_ref() };
    if f.keep(class, ptr) {
        let live = f.live_counter();
        // SAFETY: this thread's counter, alive until this store (the allocation being freed
        // keeps the heap); no reference to the front is used after it.
        unsafe { add_live(live, -(layout.size() as i64)) };
    } else {
        // SAFETY: forwarded.
        unsafe { free_arena(id, shared, ptr, layout) };
    }
    true
}

/// [`free_in`] for any layout: the thread's front (created if needed) keeps it if it can, the
/// arena takes it otherwise. The caller has checked the fork generation.
///
/// # Safety
/// As [`free_in`].
#[inline(never)]
pub(crate) unsafe fn free_any(id: u64, shared: NonNull<Shared>, ptr: NonNull<u8>, layout: Layout) {
    let size = layout.size();
    if let Some(fp) = front(id, shared) {
        // SAFETY: as in free_small.
        let f = unsafe { fp.as_ref() };
        if let Some(class) = cacheable_class(size, jemalloc::align_flags(layout)) {
            if f.keep(class, ptr) {
                let live = f.live_counter();
                // SAFETY: as in free_small.
                unsafe { add_live(live, -(size as i64)) };
                return;
            }
        }
    }
    // SAFETY: forwarded.
    unsafe { free_arena(id, shared, ptr, layout) }
}

/// [`free_in`] when the front cache does not keep the object: to the arena.
///
/// # Safety
/// As [`free_in`].
#[inline(never)]
unsafe fn free_arena(id: u64, shared: NonNull<Shared>, ptr: NonNull<u8>, layout: Layout) {
    let size = layout.size();
    let align = jemalloc::align_flags(layout);
    // The size it was allocated with (see alloc_any), with or without a front here.
    let n = alloc_size(size, align);
    match front(id, shared) {
        Some(fp) => {
            // SAFETY: as in free_in.
            let f = unsafe { fp.as_ref() };
            // SAFETY: the caller guarantees ptr/layout come from this heap's arena; n is the
            // size it was allocated with and the alignment flag matches.
            unsafe { je::sdallocx(ptr.as_ptr().cast(), n, f.tcache_flag | align) };
            let live = f.live_counter();
            // SAFETY: as in free_in.
            unsafe { add_live(live, -(size as i64)) };
        }
        None => {
            // SAFETY: as above.
            unsafe { je::sdallocx(ptr.as_ptr().cast(), n, je::MALLOCX_TCACHE_NONE | align) };
            // SAFETY: the record lives until this store (see free_raw).
            let orphan = unsafe { shared.as_ref() }.orphan_live();
            orphan.fetch_add(-(size as i64), Ordering::AcqRel);
        }
    }
}
