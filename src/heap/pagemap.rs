//! Address → chunk lookup in O(1) without locks.
//!
//! Every chunk the heap maps starts on a [`SLOT`] (2 MiB) boundary, so each 2 MiB slot of the
//! address space belongs to at most one chunk. A two-level radix table indexed by the slot number
//! stores `chunk index + 1` (0 = none): the root is a static array of leaf pointers, leaves are
//! mmap'd on first use and never freed. Reads are two atomic loads; writes happen only in the
//! extent hooks (with the chunk table's lock held) and never allocate through any heap.

use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

/// Granularity of the map and alignment of every chunk.
pub(crate) const SLOT_SHIFT: u32 = 21;
/// 2 MiB.
pub(crate) const SLOT: usize = 1 << SLOT_SHIFT;
/// User-space addresses on x86_64 / aarch64 (4-level paging) have 47 significant bits.
const ADDR_BITS: u32 = 47;
const LEAF_BITS: u32 = 13;
const ROOT_BITS: u32 = ADDR_BITS - SLOT_SHIFT - LEAF_BITS;
const LEAF_LEN: usize = 1 << LEAF_BITS;
const ROOT_LEN: usize = 1 << ROOT_BITS;

type Leaf = [AtomicU32; LEAF_LEN];

/// The map. One instance serves the whole process (`PAGEMAP`).
pub(crate) struct PageMap {
    root: [AtomicPtr<Leaf>; ROOT_LEN],
}

pub(crate) static PAGEMAP: PageMap = PageMap::new();

#[inline]
fn split(addr: usize) -> Option<(usize, usize)> {
    if addr >> ADDR_BITS != 0 {
        return None;
    }
    let slot = addr >> SLOT_SHIFT;
    Some((slot >> LEAF_BITS, slot & (LEAF_LEN - 1)))
}

impl PageMap {
    const fn new() -> PageMap {
        PageMap { root: [const { AtomicPtr::new(ptr::null_mut()) }; ROOT_LEN] }
    }

    /// The chunk index recorded for the slot holding `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: usize) -> Option<u32> {
        let (r, l) = split(addr)?;
        let leaf = self.root[r].load(Ordering::Acquire);
        if leaf.is_null() {
            return None;
        }
        // SAFETY: non-null leaves are valid, zero-initialised mappings that are never freed.
        let v = unsafe { (*leaf)[l].load(Ordering::Acquire) };
        v.checked_sub(1)
    }

    fn leaf(&self, r: usize) -> Option<&Leaf> {
        let mut leaf = self.root[r].load(Ordering::Acquire);
        if leaf.is_null() {
            // SAFETY: anonymous mapping; zeroed pages are valid AtomicU32 values.
            let p = unsafe {
                libc::mmap(
                    ptr::null_mut(),
                    std::mem::size_of::<Leaf>(),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return None;
            }
            match self.root[r].compare_exchange(ptr::null_mut(), p.cast(), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => leaf = p.cast(),
                Err(existing) => {
                    // SAFETY: p is the mapping we just made and nobody else saw it.
                    unsafe { libc::munmap(p, std::mem::size_of::<Leaf>()) };
                    leaf = existing;
                }
            }
        }
        // SAFETY: non-null leaves are valid mappings that are never freed.
        Some(unsafe { &*leaf })
    }

    /// Records `chunk` for every slot of `[base, base+len)`. `base` must be slot-aligned.
    /// Returns false (recording nothing) if a leaf could not be mapped or the range is not
    /// addressable.
    pub(crate) fn insert(&self, base: usize, len: usize, chunk: u32) -> bool {
        debug_assert_eq!(base % SLOT, 0);
        let Some(end) = base.checked_add(len) else { return false };
        let mut a = base;
        // First make sure every leaf exists, so that a failure leaves nothing half-recorded.
        while a < end {
            let Some((r, _)) = split(a) else { return false };
            if self.leaf(r).is_none() {
                return false;
            }
            a += SLOT;
        }
        let mut a = base;
        while a < end {
            let (r, l) = split(a).expect("checked above");
            self.leaf(r).expect("mapped above")[l].store(chunk + 1, Ordering::Release);
            a += SLOT;
        }
        true
    }

    /// Forgets `[base, base+len)`.
    pub(crate) fn remove(&self, base: usize, len: usize) {
        let mut a = base;
        while a < base.saturating_add(len) {
            if let Some((r, l)) = split(a) {
                let leaf = self.root[r].load(Ordering::Acquire);
                if !leaf.is_null() {
                    // SAFETY: non-null leaves are valid mappings that are never freed.
                    unsafe { (*leaf)[l].store(0, Ordering::Release) };
                }
            }
            a += SLOT;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_get_remove() {
        let m = PageMap::new();
        let base = 0x7f12_3440_0000usize & !(SLOT - 1);
        assert_eq!(m.get(base), None);
        assert!(m.insert(base, 3 * SLOT, 41));
        assert_eq!(m.get(base), Some(41));
        assert_eq!(m.get(base + 3 * SLOT - 1), Some(41));
        assert_eq!(m.get(base + 3 * SLOT), None);
        assert_eq!(m.get(base - 1), None);
        m.remove(base, 3 * SLOT);
        assert_eq!(m.get(base + SLOT), None);
    }

    #[test]
    fn out_of_range_addresses() {
        let m = PageMap::new();
        assert_eq!(m.get(usize::MAX), None);
        assert_eq!(m.get(1 << 50), None);
        assert!(!m.insert(1 << 47, SLOT, 1));
        assert!(!m.insert(usize::MAX & !(SLOT - 1), 4 * SLOT, 1));
    }
}
