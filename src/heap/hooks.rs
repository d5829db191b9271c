//! The jemalloc extent hooks.
//!
//! | hook          | what it does                                                              |
//! |---------------|---------------------------------------------------------------------------|
//! | alloc         | map + mbind + advise + `ibv_reg_mr` per bound PD (data) + publish        |
//! | dalloc        | refuse: registered memory is never returned while registered             |
//! | destroy       | nothing: the owner deregisters and unmaps whole chunks after the arena   |
//! | commit        | count it; register an idle chunk again first; zero unless pristine      |
//! | decommit      | count it (pages untouched while registered; dropped while not); a chunk  |
//! |               | decommitted whole is idle: deregistered, then its pages dropped (idle.rs)|
//! | purge_lazy    | absent (= refuse): `MADV_FREE` on pinned memory is not safe on all kernels|
//! | purge_forced  | `MADV_DONTNEED` only while the owner has no PD (nothing registered yet); |
//! |               | refuse once bound: after it the CPU and the NIC see different pages       |
//! | split         | allow                                                                     |
//! | merge         | allow within one chunk, refuse across chunks (each has its own MRs)       |
//!
//! Hooks never allocate through a heap, never unwind into C (a panic is caught and reported as
//! a failure), and report the reason of a failure through a thread-local read by the caller.

use std::panic::{catch_unwind, AssertUnwindSafe};

use libc::{c_uint, c_void};
use tikv_jemalloc_sys::extent_hooks_t;

use crate::heap::chunk;
use crate::heap::hook_error::{hook_failed, set_hook_error, HookError};
use crate::heap::owner::Owner;

type CBool = bool;

/// The hook table every heap copies into its `Owner`.
///
/// **`dalloc` must stay `Some`.** jemalloc 5.3 treats an extent whose `dalloc` hook is missing
/// as un-deallocatable, and its decay path may then purge it *itself* — with `process_madvise`
/// (`MADV_DONTNEED`) when `opt.process_madvise_max_batch > 0` — calling none of these hooks
/// (pac.c `pac_decay_stashed`, ehooks.h `ehooks_dalloc_will_fail`): the refusing `purge_*`
/// entries below would be bypassed and registered pages silently replaced (the CPU and the NIC
/// would then see different pages). A refusing `dalloc` keeps jemalloc on the hook path.
/// (The option is off by default and, in this build, setting it through `_RJEM_MALLOC_CONF`
/// did not make the purge tests fail with `dalloc: None`; the unit test
/// `hook_table_keeps_jemalloc_on_the_hook_path` pins the table's shape instead.)
pub(crate) const HOOKS: extent_hooks_t = extent_hooks_t {
    alloc: Some(hook_alloc),
    dalloc: Some(hook_dalloc),
    destroy: Some(hook_destroy),
    commit: Some(hook_commit),
    decommit: Some(hook_decommit),
    purge_lazy: None,
    purge_forced: Some(hook_purge_forced),
    split: Some(hook_split),
    merge: Some(hook_merge),
};

unsafe extern "C" fn hook_alloc(
    hooks: *mut extent_hooks_t,
    new_addr: *mut c_void,
    size: usize,
    alignment: usize,
    zero: *mut CBool,
    commit: *mut CBool,
    _arena_ind: c_uint,
) -> *mut c_void {
    if !new_addr.is_null() {
        // jemalloc asks for a specific address only to grow in place; we map fresh chunks.
        return std::ptr::null_mut();
    }
    // SAFETY: `hooks` is the first field of a live Owner (see Owner::hooks_ptr); owners outlive
    // their arenas.
    let owner = unsafe { &*(hooks as *const Owner) };
    // jemalloc's base allocator (metadata) asks with 2 MiB alignment and both zero and commit
    // requested (base.c, base_map); data extents come page-aligned with neither (retain grow),
    // or with the caller's alignment and zero flag (exact-size retry) — and mralloc never asks
    // jemalloc to zero a request aligned to 2 MiB (it zeroes those itself), so only base blocks
    // match.
    // SAFETY: jemalloc passes valid in/out pointers.
    let metadata_like = alignment >= crate::heap::pagemap::SLOT && unsafe { *zero && *commit };
    // jemalloc's growth path lets a chunk come uncommitted (`*commit` false on entry): data
    // chunks then do, so that their commit state tells when all of a chunk is free (idle.rs).
    // SAFETY: as above.
    let uncommitted = !metadata_like && unsafe { !*commit };
    let r = catch_unwind(AssertUnwindSafe(|| owner.new_chunk(size, alignment, metadata_like, uncommitted)));
    match r {
        Ok(Ok(base)) => {
            // SAFETY: jemalloc passes valid out-pointers.
            unsafe {
                *zero = true;
                *commit = !uncommitted;
            }
            base as *mut c_void
        }
        Ok(Err(e)) => {
            hook_failed(owner.is_static(), size, e);
            std::ptr::null_mut()
        }
        Err(_) => {
            set_hook_error(HookError::None);
            std::ptr::null_mut()
        }
    }
}

unsafe extern "C" fn hook_dalloc(
    _hooks: *mut extent_hooks_t,
    _addr: *mut c_void,
    _size: usize,
    _committed: CBool,
    _arena_ind: c_uint,
) -> CBool {
    true // opt out: jemalloc retains the extent
}

unsafe extern "C" fn hook_destroy(
    _hooks: *mut extent_hooks_t,
    _addr: *mut c_void,
    _size: usize,
    _committed: CBool,
    _arena_ind: c_uint,
) {
    // Whole chunks are deregistered and unmapped by Owner::release_all once the arena is gone.
}

unsafe extern "C" fn hook_commit(
    hooks: *mut extent_hooks_t,
    addr: *mut c_void,
    _size: usize,
    offset: usize,
    length: usize,
    _arena_ind: c_uint,
) -> CBool {
    // SAFETY: jemalloc passes the hooks it was given: an Owner's (see range_hook).
    unsafe { range_hook(hooks, addr, offset, length, Owner::commit) }
}

unsafe extern "C" fn hook_decommit(
    hooks: *mut extent_hooks_t,
    addr: *mut c_void,
    _size: usize,
    offset: usize,
    length: usize,
    _arena_ind: c_uint,
) -> CBool {
    // SAFETY: as in hook_commit.
    unsafe { range_hook(hooks, addr, offset, length, Owner::decommit) }
}

unsafe extern "C" fn hook_purge_forced(
    hooks: *mut extent_hooks_t,
    addr: *mut c_void,
    _size: usize,
    offset: usize,
    length: usize,
    _arena_ind: c_uint,
) -> CBool {
    // SAFETY: as in hook_commit.
    unsafe { range_hook(hooks, addr, offset, length, |o, start, len| !o.purge_unregistered(start, len)) }
}

/// The body of the hooks on a range of an extent (commit, decommit, purge): `f` on the owner
/// with `[addr + offset, addr + offset + length)`. `true` fails or refuses; so does any panic
/// (nothing is handed out, nothing given back, on doubt), which never unwinds into jemalloc.
///
/// # Safety
/// `hooks` is the `extent_hooks_t` jemalloc was given for an arena: the first field of a live
/// `Owner` (as in `hook_alloc`).
unsafe fn range_hook(
    hooks: *mut extent_hooks_t,
    addr: *mut c_void,
    offset: usize,
    length: usize,
    f: impl FnOnce(&Owner, usize, usize) -> bool,
) -> CBool {
    // SAFETY: the caller's contract.
    let owner = unsafe { &*(hooks as *const Owner) };
    catch_unwind(AssertUnwindSafe(|| f(owner, addr as usize + offset, length))).unwrap_or(true)
}

unsafe extern "C" fn hook_split(
    _hooks: *mut extent_hooks_t,
    _addr: *mut c_void,
    _size: usize,
    _size_a: usize,
    _size_b: usize,
    _committed: CBool,
    _arena_ind: c_uint,
) -> CBool {
    false // allow
}

/// Called on every free of a large block (above jemalloc's thread-cache limit) that has a free
/// neighbour: one page-map lookup, not one per extent.
unsafe extern "C" fn hook_merge(
    _hooks: *mut extent_hooks_t,
    addr_a: *mut c_void,
    size_a: usize,
    addr_b: *mut c_void,
    size_b: usize,
    _committed: CBool,
    _arena_ind: c_uint,
) -> CBool {
    if merges_within_one_chunk(addr_a as usize, size_a, addr_b as usize, size_b) {
        false // allow
    } else {
        crate::heap::stats::CROSS_CHUNK_MERGES_REFUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }
}

/// Whether extents `a` and `b` (`b` right after `a`, as jemalloc merges them) lie in one chunk a
/// heap handed out: the chunk of `a`'s first byte holds all of `[a, b + size_b)`. Anything else
/// (not adjacent, either end outside that chunk, no chunk at all) is refused.
fn merges_within_one_chunk(a: usize, size_a: usize, b: usize, size_b: usize) -> bool {
    a.checked_add(size_a) == Some(b)
        && size_a.checked_add(size_b).is_some_and(|len| chunk::find_range(a, len.max(1)).is_some())
}

#[cfg(test)]
mod tests {
    /// The table's shape is a safety property: which entries exist decides which of jemalloc's
    /// paths can reach registered pages without asking (see [`super::HOOKS`]).
    #[test]
    fn hook_table_keeps_jemalloc_on_the_hook_path() {
        let h = super::HOOKS;
        assert!(h.dalloc.is_some(), "dalloc: None lets jemalloc purge extents without the purge hooks");
        assert!(h.purge_forced.is_some(), "purge_forced returns unbound memory to the OS");
        assert!(h.merge.is_some() && h.split.is_some(), "merge/split must stay hooked (cross-chunk merges)");
        assert!(h.alloc.is_some() && h.destroy.is_some() && h.commit.is_some());
        assert!(h.decommit.is_some(), "decommit counts free memory for idle release");
        assert!(h.purge_lazy.is_none(), "refused by absence");
    }

    /// The merge hook allows exactly the merges inside one chunk: two chunks side by side (as
    /// two mappings may be) are never joined, nor is memory no heap handed out.
    #[test]
    fn merges_stay_inside_one_chunk() {
        use crate::heap::chunk;
        use crate::heap::pagemap::SLOT;
        let base = chunk::map(2 * SLOT, SLOT).unwrap();
        let owner = u64::MAX - 11;
        let (first, second) = (
            chunk::publish(owner, base, SLOT, false).unwrap(),
            chunk::publish(owner, base + SLOT, SLOT, false).unwrap(),
        );
        let merges =
            |a: usize, size_a: usize, size_b: usize| super::merges_within_one_chunk(a, size_a, a + size_a, size_b);
        assert!(merges(base, 4096, 4096));
        assert!(merges(base, SLOT - 4096, 4096), "up to the chunk's end");
        assert!(merges(base + SLOT, 64 << 10, SLOT - (64 << 10)), "the second chunk, all of it");
        assert!(!merges(base, SLOT, 4096), "b starts the next chunk");
        assert!(!merges(base + SLOT - 4096, 4096, 4096), "b starts the next chunk, a small one");
        assert!(!merges(base, SLOT - 4096, 8192), "b runs into the next chunk");
        assert!(!merges(base + SLOT, SLOT, 4096), "b past the last chunk");
        assert!(!super::merges_within_one_chunk(base, 4096, base + 8192, 4096), "not adjacent");
        assert!(!super::merges_within_one_chunk(usize::MAX - 4095, 4096, 0, 4096), "wraps around");
        chunk::release(second);
        assert!(!merges(base + SLOT, 4096, 4096), "no chunk there any more");
        assert!(merges(base, 4096, 4096));
        chunk::release(first);
        assert!(!merges(base, 4096, 4096), "no chunk at all");
        chunk::unmap(base, 2 * SLOT);
    }
}
