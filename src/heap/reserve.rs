//! `Heap::reserve`: growing a heap ahead of time, so that later allocations make no chunk.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use tikv_jemalloc_sys as je;

use crate::error::{Error, Result};
use crate::heap::hook_error::HookError;
use crate::heap::pagemap::SLOT;
use crate::heap::paths::mallocx_or_flush;
use crate::heap::scoped::Heap;

impl Heap {
    /// Maps and registers at least `bytes` more memory now, so that allocations it can serve
    /// later make no new chunk: call it at start-up to keep `ibv_reg_mr` (milliseconds per
    /// chunk, hundreds of them for a large one) off the hot path. The memory is registered with
    /// every PD the heap is bound to (and with later ones at bind time), counts in
    /// [`crate::heap::HeapStats::mapped_bytes`], and stays with the heap until it is dropped: the
    /// chunks it makes are never released as idle ([`crate::heap::HeapBuilder::idle_release`]),
    /// nor are those other threads make while it runs.
    ///
    /// Count the buffers by their size classes and leave some headroom: classes are four per
    /// doubling (a 1 MiB buffer takes 1 MiB, one of 1 MiB + 64 B takes the 1.25 MiB class), an
    /// allocation above 16 KiB takes one page beyond its class, and chunk ends fragment (a
    /// sixteenth more than the classes' total is plenty). Chunks other
    /// threads make meanwhile count toward `bytes`, and while `reserve` runs the memory it
    /// holds is not available to them.
    ///
    /// Internally, blocks of up to half a [`crate::heap::HeapBuilder::max_chunk`] are allocated until the
    /// heap has grown by `bytes`, then freed; jemalloc keeps the freed extents in the arena
    /// (and never releases the reserved chunks) and serves later allocations from them.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`], before anything is mapped, if `bytes` does not fit under the
    /// heap's [`crate::heap::HeapBuilder::limit`]; [`Error::Registration`], [`Error::Io`] or
    /// [`Error::OutOfMemory`] if a chunk could not be mapped, bound or registered (the chunks
    /// made before the failure stay with the heap). Nothing stays allocated either way.
    /// [`Error::Forked`] in a fork()ed child of the process that made the heap (nothing is
    /// mapped: the heap is the parent's).
    pub fn reserve(&self, bytes: usize) -> Result<()> {
        const PAGE: usize = 4096;
        // Checked before anything of the heap is touched (a parent thread may have held its
        // arena's locks at the fork).
        self.born().check("this heap")?;
        let s = self.shared();
        let mapped = || s.owner.counters.mapped.load(Ordering::Relaxed) as usize;
        let start = mapped();
        if bytes > s.owner.limit.saturating_sub(start) {
            return Err(Error::LimitExceeded { limit: s.owner.limit, mapped: start, requested: bytes });
        }
        let target = start + bytes;
        // The chunks made from here on are the reservation: never released as idle.
        let _keeping = s.owner.keeping();
        let block = (s.max_chunk / 2).clamp(SLOT, 64 << 20);
        let flags = je::MALLOCX_ARENA(self.arena as usize) | je::MALLOCX_TCACHE_NONE;
        // The blocks held so far, as an intrusive list (no allocation here): each block's
        // first 16 bytes hold the previous block and this block's size.
        let mut held: Option<(NonNull<u8>, usize)> = None;
        let mut result = Ok(());
        while mapped() < target {
            let mut want = block_size((target - mapped()).min(block));
            let p = loop {
                // SAFETY: want >= one page; flags name our arena and no tcache; the depot is the
                // heap's.
                match unsafe { mallocx_or_flush(None, s.registry().depot(), want, flags) } {
                    Ok(p) => break Some(p),
                    // Near the limit a smaller block may still fit (a chunk holds a block plus
                    // a page of padding).
                    Err(HookError::Limit { .. }) if want > PAGE => want = block_size(want / 2),
                    Err(e) => {
                        result = Err(e.into_error(bytes));
                        break None;
                    }
                }
            };
            let Some(p) = p else { break };
            // SAFETY: p is a fresh, writable allocation of want >= 4096 bytes, 16-aligned.
            unsafe { p.as_ptr().cast::<Option<(NonNull<u8>, usize)>>().write(held) };
            held = Some((p, want));
        }
        crate::heap::events::emit_pending();
        while let Some((p, size)) = held {
            // SAFETY: written above, before the block was added to the list.
            held = unsafe { p.as_ptr().cast::<Option<(NonNull<u8>, usize)>>().read() };
            // SAFETY: allocated above with this size and flags, freed once.
            unsafe { je::sdallocx(p.as_ptr().cast(), size, flags) };
        }
        result
    }
}

/// The size of a block `reserve` allocates to grow the heap by about `bytes`: a page multiple
/// one page short of a 2 MiB multiple, so that with jemalloc's page of padding behind a large
/// block the extent is a whole number of 2 MiB. Under page-sized large classes (jemalloc's
/// default in this build) an extent taken from fresh memory is rounded up to the next size
/// class or 2 MiB multiple, whichever is smaller, and the rest parked as a fragment: such
/// fragments, left by reserve's own blocks, were taken by later buffers that could use only
/// part of them, and a reserved growth ran short. Small requests are page multiples.
fn block_size(bytes: usize) -> usize {
    const PAGE: usize = 4096;
    const HUGE: usize = 2 << 20;
    if bytes <= HUGE / 2 {
        bytes.max(PAGE).next_multiple_of(PAGE)
    } else {
        bytes.next_multiple_of(HUGE) - PAGE
    }
}
