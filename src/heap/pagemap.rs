//! Address → chunk lookup in O(1) without locks.
//!
//! Every chunk the heap maps starts on a [`SLOT`] (2 MiB) boundary, so each 2 MiB slot of the
//! address space belongs to at most one chunk. A three-level radix table indexed by the slot
//! number stores `chunk index + 1` (0 = none): the root is a static array of pointers to middle
//! nodes, which point to leaves; nodes are mmap'd on first use and never freed. Reads are three
//! atomic loads; writes happen when chunks are published or released (each slot by one writer:
//! slots of live chunks are disjoint; nodes are created with a compare-and-swap) and never
//! allocate through any heap.
//!
//! It covers [`ADDR_BITS`] = 57 bits: every user address of x86_64 with 4-level (47-bit) or
//! 5-level (56-bit) paging and of aarch64 with 48- or 52-bit virtual addresses.

use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

/// Granularity of the map and alignment of every chunk.
pub(crate) const SLOT_SHIFT: u32 = 21;
/// 2 MiB.
pub(crate) const SLOT: usize = 1 << SLOT_SHIFT;
/// Significant bits of a user-space address the map covers (x86_64 LA57: 56; aarch64 LVA: 52).
pub(crate) const ADDR_BITS: u32 = 57;
const LEVEL_BITS: u32 = 12;
const LEN: usize = 1 << LEVEL_BITS;
const _: () = assert!(SLOT_SHIFT + 3 * LEVEL_BITS == ADDR_BITS);

type Leaf = [AtomicU32; LEN];
type Mid = [AtomicPtr<Leaf>; LEN];

/// The map. One instance serves the whole process (`PAGEMAP`).
pub(crate) struct PageMap {
    root: [AtomicPtr<Mid>; LEN],
}

pub(crate) static PAGEMAP: PageMap = PageMap::new();

/// (root, middle, leaf) indices of the slot holding `addr`; `None` above [`ADDR_BITS`].
#[inline]
fn split(addr: usize) -> Option<(usize, usize, usize)> {
    if (addr as u64) >> ADDR_BITS != 0 {
        return None;
    }
    let slot = addr >> SLOT_SHIFT;
    let mask = LEN - 1;
    Some((slot >> (2 * LEVEL_BITS), (slot >> LEVEL_BITS) & mask, slot & mask))
}

/// A zeroed node of `T` from an anonymous mapping (zero is a valid value of every node type:
/// null pointers, zero counts), published into `at` unless another thread was first.
fn node<T>(at: &AtomicPtr<T>) -> Option<&T> {
    let mut p = at.load(Ordering::Acquire);
    if p.is_null() {
        // SAFETY: an anonymous private mapping of the node's size; no memory of ours is touched.
        let fresh = unsafe {
            libc::mmap(
                ptr::null_mut(),
                std::mem::size_of::<T>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if fresh == libc::MAP_FAILED {
            return None;
        }
        match at.compare_exchange(ptr::null_mut(), fresh.cast(), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => p = fresh.cast(),
            Err(existing) => {
                // SAFETY: `fresh` is the mapping we just made and nobody else saw it.
                unsafe { libc::munmap(fresh, std::mem::size_of::<T>()) };
                p = existing;
            }
        }
    }
    // SAFETY: non-null nodes are valid, zero-initialised mappings that are never freed.
    Some(unsafe { &*p })
}

impl PageMap {
    const fn new() -> PageMap {
        PageMap { root: [const { AtomicPtr::new(ptr::null_mut()) }; LEN] }
    }

    /// The leaf entry of `addr`'s slot, if its nodes exist.
    #[inline]
    fn entry(&self, addr: usize) -> Option<&AtomicU32> {
        let (r, m, l) = split(addr)?;
        let mid = self.root[r].load(Ordering::Acquire);
        if mid.is_null() {
            return None;
        }
        // SAFETY: non-null nodes are valid mappings that are never freed.
        let leaf = unsafe { (*mid)[m].load(Ordering::Acquire) };
        if leaf.is_null() {
            return None;
        }
        // SAFETY: as above.
        Some(unsafe { &(*leaf)[l] })
    }

    /// The chunk index recorded for the slot holding `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: usize) -> Option<u32> {
        self.entry(addr)?.load(Ordering::Acquire).checked_sub(1)
    }

    /// The leaf entry of `addr`'s slot, mapping its nodes if needed.
    fn entry_or_map(&self, addr: usize) -> Option<&AtomicU32> {
        let (r, m, l) = split(addr)?;
        let mid = node(&self.root[r])?;
        let leaf = node(&mid[m])?;
        Some(&leaf[l])
    }

    /// Records `chunk` for every slot of `[base, base+len)`. `base` must be slot-aligned.
    /// Returns false (recording nothing) if a node could not be mapped or the range is not
    /// addressable.
    pub(crate) fn insert(&self, base: usize, len: usize, chunk: u32) -> bool {
        debug_assert_eq!(base % SLOT, 0);
        let Some(end) = base.checked_add(len) else { return false };
        // First make sure every node exists, so that a failure leaves nothing half-recorded.
        if (base..end).step_by(SLOT).any(|a| self.entry_or_map(a).is_none()) {
            return false;
        }
        for a in (base..end).step_by(SLOT) {
            self.entry_or_map(a).expect("mapped above").store(chunk + 1, Ordering::Release);
        }
        true
    }

    /// Forgets `[base, base+len)`.
    pub(crate) fn remove(&self, base: usize, len: usize) {
        for a in (base..base.saturating_add(len)).step_by(SLOT) {
            if let Some(e) = self.entry(a) {
                e.store(0, Ordering::Release);
            }
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
        assert_eq!(m.get(1 << 50), None, "nothing recorded there");
        assert!(!m.insert(1 << 57, SLOT, 1), "above 57 bits");
        assert!(!m.insert(usize::MAX & !(SLOT - 1), 4 * SLOT, 1));
    }

    /// The top of every user address space the map must cover: x86_64 4-level (47 bits) and
    /// 5-level (56/57 bits), aarch64 48- and 52-bit VAs. (Before: 47 bits only, so chunks above
    /// 2^47 failed as "the chunk table is full".)
    #[test]
    fn covers_48_52_and_57_bit_address_spaces() {
        let m = PageMap::new();
        for (i, bits) in [47u32, 48, 52, 56, 57].into_iter().enumerate() {
            let top = ((1usize << bits) - 1) & !(SLOT - 1); // the last slot below 2^bits
            let low = 1usize << (bits - 1); // the first slot of the upper half
            for (j, base) in [top, low].into_iter().enumerate() {
                let chunk = (10 * i + j) as u32;
                assert!(m.insert(base, SLOT, chunk), "{bits}-bit slot {base:#x}");
                assert_eq!(m.get(base), Some(chunk));
                assert_eq!(m.get(base + SLOT - 1), Some(chunk));
            }
        }
        // Distinct slots never alias: the index math keeps every bit.
        let (r, mid, l) = split(((1usize << 57) - 1) & !(SLOT - 1)).unwrap();
        assert_eq!((r, mid, l), (LEN - 1, LEN - 1, LEN - 1));
        assert_eq!(split(1 << 47), Some((1 << (47 - 21 - 24), 0, 0)));
        assert_eq!(split(1 << 52), Some((1 << (52 - 21 - 24), 0, 0)));
        assert_ne!(split(1 << 47), split(1 << 48));
        m.remove(1 << 51, SLOT);
        assert_eq!(m.get(1 << 51), None);
        assert_eq!(m.get(((1usize << 52) - 1) & !(SLOT - 1)), Some(20), "its neighbours stay");
    }
}
