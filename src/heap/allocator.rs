//! The scoped heap as an allocator of collections: the `Allocator` trait of allocator-api2 0.4
//! (its own `Vec`, `Box`) and of allocator-api2 0.2 (hashbrown's `HashMap`/`HashSet`, which
//! implement their allocator parameter over that version). Both are the same code: the front
//! cache first, then the arena.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::heap::paths::{alloc_any, free_any, free_small, take_small};
use crate::heap::scoped::Heap;

use allocator_api2::alloc::AllocError;

/// `Allocator::allocate` past the front cache's fast path (kept out of line: it is the slow
/// path): a fork()ed child's refusal, zero sizes, then [`alloc_any`].
#[inline(never)]
fn allocate_any(heap: &Heap, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
    if !heap.born().here() {
        return Err(AllocError); // a parent's heap in a fork()ed child
    }
    if layout.size() == 0 {
        // Zero-sized: a dangling, well-aligned pointer (never passed to jemalloc).
        let p = NonNull::new(layout.align() as *mut u8).ok_or(AllocError)?;
        return Ok(NonNull::slice_from_raw_parts(p, 0));
    }
    match alloc_any(heap, layout, false) {
        Ok(p) => Ok(NonNull::slice_from_raw_parts(p, layout.size())),
        Err(e) => {
            tracing::debug!("Heap allocation of {} bytes failed: {e}", layout.size());
            Err(AllocError)
        }
    }
}

/// `Allocator::deallocate` past the front cache's fast path.
///
/// # Safety
/// As `Allocator::deallocate`.
#[inline(never)]
unsafe fn deallocate_any(heap: &Heap, ptr: NonNull<u8>, layout: Layout) {
    if layout.size() != 0 && heap.born().here() {
        // SAFETY: the Allocator contract: ptr was allocated by this heap with layout; the id
        // is this handle's copy of the record's; the generation was checked.
        unsafe { free_any(heap.id(), heap.shared_ptr(), ptr, layout) };
    }
}

// SAFETY: allocate/deallocate pair through the same arena and layout, and the memory stays
// valid until deallocated: every handle and every allocation keeps the heap alive. Clones of a
// handle are the same heap, so memory from one can be freed through another. (`&Heap` is an
// allocator through allocator-api2's blanket impl for references.)
unsafe impl allocator_api2::alloc::Allocator for Heap {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        match take_small(self, layout) {
            Some(p) => Ok(NonNull::slice_from_raw_parts(p, layout.size())),
            None => allocate_any(self, layout),
        }
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the Allocator contract: ptr was allocated by this heap with layout; the id is
        // this handle's copy of the record's.
        if !unsafe { free_small(self.id(), self.shared_ptr(), ptr, layout) } {
            // SAFETY: as above.
            unsafe { deallocate_any(self, ptr, layout) }
        }
    }
}

// SAFETY: allocator-api2 0.2's trait has the same contract as 0.4's (both are the standard
// library's `Allocator`), and this forwards to the implementation above: memory from either
// trait can be freed through either.
unsafe impl allocator_api2_02::alloc::Allocator for Heap {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, allocator_api2_02::alloc::AllocError> {
        allocator_api2::alloc::Allocator::allocate(self, layout).map_err(|_| allocator_api2_02::alloc::AllocError)
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's contract, which is 0.4's.
        unsafe { allocator_api2::alloc::Allocator::deallocate(self, ptr, layout) }
    }
}
