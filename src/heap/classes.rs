//! The size classes of a scoped heap's front cache ([`crate::heap::front`]).
//!
//! The classes are jemalloc's (a quantum of 16 bytes, four classes per doubling, as upstream
//! jemalloc sizes small and large blocks alike). Every request the front could keep — up to
//! [`MAX_CACHED`] bytes, no alignment flag — is allocated from jemalloc as its class size and
//! freed with that size ([`alloc_size`]), whether or not a front cache exists on the thread and
//! whatever jemalloc's own size classes are: an object kept under a class is exactly what
//! `mallocx(class size)` returned and serves any request of that class. (This jemalloc build
//! sizes large blocks by the page unless its `malloc_conf` says `disable_large_size_classes:false`;
//! rounding here keeps the front correct either way. It does not change how this build grows
//! an arena under page sizing: each large block cut from fresh memory is taken at the next
//! class of its size plus a page, the rest parked; see `conf.rs`.)

use std::alloc::Layout;

use tikv_jemalloc_sys as je;

/// The largest size the front caches.
pub(crate) const MAX_CACHED: usize = 1 << 20;
/// Size classes up to [`MAX_CACHED`]: 8, 16, 32, 48, 64, then four per doubling up to 1 MiB.
pub(crate) const NCLASSES: usize = class_of(MAX_CACHED).0 + 1;

/// A size class (an index below [`NCLASSES`]: only this module makes one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Class(u8);

impl Class {
    /// The class's index, below [`NCLASSES`].
    #[inline(always)]
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }

    /// Every class, smallest first.
    pub(crate) fn all() -> impl Iterator<Item = Class> {
        (0..NCLASSES as u8).map(Class)
    }

    /// Its size in bytes.
    #[inline(always)]
    pub(crate) fn size(self) -> usize {
        CLASS_SIZE[self.index()]
    }
}

/// The size class of `size` (1..=[`MAX_CACHED`]): its index and size. A quantum of 16 bytes and
/// four classes per doubling, small and large alike (upstream jemalloc's classes).
#[inline]
pub(crate) const fn class_of(size: usize) -> (usize, usize) {
    if size <= 16 {
        return if size <= 8 { (0, 8) } else { (1, 16) };
    }
    // 2^lg < size <= 2^(lg + 1).
    let lg = (usize::BITS - 1 - (size - 1).leading_zeros()) as usize;
    if lg < 6 {
        // (16, 64]: one class per quantum (32, 48, 64).
        let c = (size + 15) & !15;
        return (c / 16, c);
    }
    // Four classes per doubling: 5/4, 6/4, 7/4 and 8/4 of 2^lg.
    let shift = lg - 2;
    let quarters = ((size - 1) >> shift) + 1;
    (5 + (lg - 6) * 4 + (quarters - 5), quarters << shift)
}

/// The size of class `idx`.
const fn class_size(idx: usize) -> usize {
    match idx {
        0 => 8,
        1..=4 => idx * 16,
        _ => {
            let (lg, q) = (6 + (idx - 5) / 4, 5 + (idx - 5) % 4);
            q << (lg - 2)
        }
    }
}

/// The size a scoped heap asks jemalloc for, and frees with, for a request of `size` bytes
/// (> 0) with alignment flag `align_flag`: the class size for what a front cache could keep, the
/// size itself otherwise. Independent of the thread's front (or its absence), so memory
/// allocated on one thread is freed with the same size on any other.
#[inline(always)]
pub(crate) fn alloc_size(size: usize, align_flag: libc::c_int) -> usize {
    cacheable_class(size, align_flag).map_or(size, Class::size)
}

/// The class of a request a front cache could keep (1 to [`MAX_CACHED`] bytes, no alignment
/// flag); `None` for any other. The one rule [`alloc_size`] and [`small_class`] follow.
#[inline(always)]
pub(crate) fn cacheable_class(size: usize, align_flag: libc::c_int) -> Option<Class> {
    (align_flag == 0 && size <= MAX_CACHED).then(|| class_fast(size))
}

/// [`cacheable_class`] for the sizes allocated most often — 8 to [`SMALL_MAX`] bytes aligned to
/// at most 8, which never need an alignment flag — in two comparisons and a table load; `None`
/// for every other layout (which may still be cacheable: ask [`cacheable_class`]).
#[inline(always)]
pub(crate) fn small_class(layout: Layout) -> Option<Class> {
    let size = layout.size();
    // 8 <= size <= SMALL_MAX in one unsigned comparison; align <= 8 <= size: no flag.
    if size.wrapping_sub(8) <= SMALL_MAX - 8 && layout.align() <= 8 {
        Some(Class(SMALL_INDEX[(size + 7) >> 3]))
    } else {
        None
    }
}

/// Whether jemalloc hands out exactly [`class_of`]'s sizes for every class (`nallocx`): not
/// needed for correctness (see [`alloc_size`]), but if jemalloc rounds a class up (another page
/// size, another build), the difference is memory no request uses; logged once as a warning.
pub(crate) fn check_classes_once() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        // SAFETY: nallocx only computes a size.
        let odd = (0..NCLASSES).map(class_size).find(|&c| unsafe { je::nallocx(c, 0) } != c);
        if let Some(c) = odd {
            tracing::warn!(
                "jemalloc rounds the {c}-byte size class up to {} bytes: scoped heaps waste the difference",
                // SAFETY: as above.
                unsafe { je::nallocx(c, 0) }
            );
        }
    });
}

/// Size of each class, by index.
static CLASS_SIZE: [usize; NCLASSES] = {
    let mut t = [0; NCLASSES];
    let mut i = 0;
    while i < NCLASSES {
        t[i] = class_size(i);
        i += 1;
    }
    t
};

/// Class index of the sizes up to [`SMALL_MAX`], in steps of 8 bytes: `SMALL_INDEX[(size + 7) / 8]`.
/// One load instead of [`class_of`]'s arithmetic for the sizes allocated most often.
static SMALL_INDEX: [u8; SMALL_MAX / 8 + 1] = {
    let mut t = [0u8; SMALL_MAX / 8 + 1];
    let mut i = 1;
    while i <= SMALL_MAX / 8 {
        t[i] = class_of(i * 8).0 as u8;
        i += 1;
    }
    t
};
const SMALL_MAX: usize = 4096;
// Every class index fits the table's bytes.
const _: () = assert!(NCLASSES <= u8::MAX as usize);

/// [`class_of`], through [`SMALL_INDEX`] up to 4 KiB.
#[inline(always)]
fn class_fast(size: usize) -> Class {
    if size <= SMALL_MAX {
        Class(SMALL_INDEX[(size + 7) >> 3])
    } else {
        Class(class_of(size).0 as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_jemallocs() {
        let mut last = (usize::MAX, 0);
        for size in 1..=MAX_CACHED {
            let (idx, c) = class_of(size);
            assert_eq!(class_fast(size), Class(idx as u8), "lookup table at {size}");
            assert_eq!(alloc_size(size, 0), c, "allocation size of {size}");
            assert_eq!(class_size(idx), c, "size of class {idx}");
            assert_eq!(Class(idx as u8).size(), c, "size table of class {idx}");
            // jemalloc hands out exactly the class (its own classes are the same for small
            // sizes, and large classes are page multiples).
            // SAFETY: nallocx only computes a size.
            assert_eq!(unsafe { je::nallocx(c, 0) }, c, "jemalloc's size for class {idx}");
            if idx != last.0 {
                assert!(idx == last.0.wrapping_add(1), "classes are numbered densely ({size})");
                last = (idx, c);
            }
        }
        assert_eq!(last.0, NCLASSES - 1);
        assert_eq!(Class::all().count(), NCLASSES);
        assert_eq!(alloc_size(MAX_CACHED + 1, 0), MAX_CACHED + 1, "past the front: as asked");
        assert_eq!(alloc_size(100, 4), 100, "an alignment flag: as asked");
    }

    /// The fast lookup agrees with the full rule wherever it answers, and answers for 8 bytes
    /// to 4 KiB at alignments up to 8.
    #[test]
    fn the_small_lookup_is_the_full_rule() {
        for size in 0..=SMALL_MAX + 64 {
            for align in [1, 2, 4, 8, 16, 32, 4096] {
                let layout = Layout::from_size_align(size, align).unwrap();
                let full =
                    (size > 0).then(|| cacheable_class(size, crate::heap::jemalloc::align_flags(layout))).flatten();
                match small_class(layout) {
                    Some(c) => assert_eq!(Some(c), full, "{size} aligned to {align}"),
                    None => assert!(!(8..=SMALL_MAX).contains(&size) || align > 8, "{size} aligned to {align}"),
                }
            }
        }
    }
}
