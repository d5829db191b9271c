//! The front cache of a scoped heap: per thread, per heap, one magazine of free objects per
//! size class, in front of jemalloc.
//!
//! jemalloc's path for an explicit arena and thread cache (`mallocx` with flags) costs several
//! times its plain `malloc`. A freed object therefore goes into the freeing thread's magazine
//! for its class, and the next allocation of that class on that thread takes it back: a thread
//! that allocates and frees RDMA buffers of the same sizes never reaches jemalloc. Objects freed
//! on another thread than the one that allocated them go into the freeing thread's magazine, as
//! jemalloc's own thread caches do: no lock on either path.
//!
//! Bounds: each class keeps at most [`cap_of`] objects; a full magazine hands half of them back
//! to jemalloc at once. Over all classes a thread keeps at most the heap's
//! [`crate::heap::HeapBuilder::thread_cache`] bytes; a free beyond that goes to jemalloc. What
//! is kept shows in [`crate::heap::HeapStats::thread_cached_bytes`]. Thread exit and the heap's
//! teardown return everything to jemalloc.
//!
//! The classes are jemalloc's own (a quantum of 16 bytes, four classes per doubling), so an
//! object kept under a class is exactly what `mallocx(class size)` returns, freed with
//! `sdallocx(class size)`, and serves any request of that class. Only requests whose alignment
//! the class already guarantees are cached (no alignment flag, see `jemalloc::align_flags`).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicI64, Ordering};

use tikv_jemalloc_sys as je;

use crate::heap::tcache::Counter;

/// The largest size the front caches.
pub(crate) const MAX_CACHED: usize = 1 << 20;
/// Size classes up to [`MAX_CACHED`]: 41 up to 32 KiB, then one per 4 KiB page.
pub(crate) const NCLASSES: usize = 41 + (MAX_CACHED - (32 << 10)) / PAGE_CLASS;
/// Default of [`crate::heap::HeapBuilder::thread_cache`]: bytes a thread may keep per heap.
pub const DEFAULT_THREAD_CACHE: usize = 4 << 20;

/// Above 32 KiB, jemalloc's classes (as built for mralloc) are every page.
const PAGE_CLASS: usize = 4096;

/// jemalloc's size class of `size` (1..=[`MAX_CACHED`]): its index and size. Up to 32 KiB a
/// quantum of 16 bytes and four classes per doubling; above, one class per page. Checked
/// against jemalloc itself before any cache is used ([`classes_match_jemalloc`]).
#[inline]
pub(crate) fn class_of(size: usize) -> (usize, usize) {
    debug_assert!(size > 0 && size <= MAX_CACHED);
    if size > 32 << 10 {
        let pages = size.div_ceil(PAGE_CLASS);
        return (pages + 32, pages * PAGE_CLASS);
    }
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

/// Whether [`class_of`] is jemalloc's own sizing (asked once, with `nallocx`, at every class
/// boundary). If not (another jemalloc build or page size), heaps keep no front cache: an
/// object freed with a size of another class would corrupt jemalloc.
pub(crate) fn classes_match_jemalloc() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        let ok = (0..NCLASSES).all(|i| {
            let c = class_size(i);
            let prev = if i == 0 { 0 } else { class_size(i - 1) };
            // SAFETY: nallocx only computes a size.
            let (at, after_prev) = unsafe { (je::nallocx(c, 0), je::nallocx(prev + 1, 0)) };
            at == c && after_prev == c && class_of(c) == (i, c) && class_of(prev + 1) == (i, c)
        });
        if !ok {
            tracing::warn!("jemalloc's size classes are not the ones mralloc expects: heaps run without front caches");
        }
        ok
    })
}

/// How many objects of `class_size` a magazine keeps: 256 KiB worth, between 1 and 64.
pub(crate) fn cap_of(class_size: usize) -> usize {
    ((256 << 10) / class_size).clamp(1, 64)
}

struct Magazine {
    items: Vec<NonNull<u8>>,
    cap: usize,
}

/// One thread's front cache for one heap. Only its thread touches the magazines, except at
/// teardown ([`Front::flush_all`]) when that thread is gone or can no longer use the heap.
pub(crate) struct Front {
    /// The thread's jemalloc tcache for the heap (`MALLOCX_TCACHE` flag ready to use).
    pub(crate) tcache_flag: libc::c_int,
    /// The thread's counters for the heap (owned by the heap's registry, which outlives this).
    counter: *const Counter,
    mags: Box<[Magazine]>,
    /// Bytes kept in the magazines, and the bound.
    bytes: usize,
    limit: usize,
}

impl Front {
    pub(crate) fn new(tcache: u32, counter: &Counter, limit: usize) -> Front {
        // A disabled cache (bound 0) has no magazines: `class_for` sends everything past it.
        let n = if limit == 0 { 0 } else { NCLASSES };
        let mags = (0..n)
            .map(|i| {
                let cap = cap_of(class_size(i));
                Magazine { items: Vec::with_capacity(cap), cap }
            })
            .collect();
        Front { tcache_flag: je::MALLOCX_TCACHE(tcache as usize), counter, mags, bytes: 0, limit }
    }

    /// The class (index, size) under which this cache serves a request of `size` bytes whose
    /// jemalloc alignment flag is `align_flag`; `None`: not cached, the request takes the plain
    /// path. Allocation and free ask the same question, so an object is always freed the way
    /// it was allocated. A disabled cache (bound 0) serves nothing, and nothing is rounded.
    #[inline]
    pub(crate) fn class_for(&self, size: usize, align_flag: libc::c_int) -> Option<(usize, usize)> {
        (align_flag == 0 && size <= MAX_CACHED && self.limit != 0).then(|| class_of(size))
    }

    /// The thread's live-byte counter for the heap.
    #[inline]
    pub(crate) fn live(&self) -> *const AtomicI64 {
        // SAFETY: the counter lives in the heap's registry as long as the heap, longer than
        // any front of it.
        unsafe { &(*self.counter).live }
    }

    /// Publishes `bytes` for statistics (this thread is the only writer).
    #[inline]
    fn show(&self) {
        // SAFETY: as in `live`.
        unsafe { &(*self.counter).cached }.store(self.bytes as u64, Ordering::Relaxed);
    }

    /// A kept object of class `idx` (of `class_size` bytes), if any.
    #[inline]
    pub(crate) fn take(&mut self, idx: usize, class_size: usize) -> Option<NonNull<u8>> {
        let p = self.mags[idx].items.pop()?;
        self.bytes -= class_size;
        self.show();
        Some(p)
    }

    /// Keeps `p`, an object of class `idx`; gives it back if the cache is full (the caller frees
    /// it to jemalloc). A full magazine first hands half of its objects back to jemalloc.
    #[inline]
    pub(crate) fn keep(&mut self, idx: usize, class_size: usize, p: NonNull<u8>) -> Option<NonNull<u8>> {
        if self.bytes + class_size > self.limit {
            return Some(p);
        }
        let m = &mut self.mags[idx];
        if m.items.len() >= m.cap {
            // Hand back the older half (the bottom of the stack), keep the recently freed.
            let flag = self.tcache_flag;
            for q in m.items.drain(..m.cap.div_ceil(2)) {
                // SAFETY: a kept object is a live allocation of exactly class_size bytes from
                // this heap's arena (mallocx(class_size) or a request of that class); it leaves
                // the magazine here, so it is freed once.
                unsafe { je::sdallocx(q.as_ptr().cast(), class_size, flag) };
                self.bytes -= class_size;
            }
        }
        self.mags[idx].items.push(p);
        self.bytes += class_size;
        self.show();
        None
    }

    /// Hands every kept object back to jemalloc (through the thread's tcache, which the caller
    /// destroys next). Called at thread exit or heap teardown, when no thread can reach this
    /// cache otherwise.
    pub(crate) fn flush_all(&mut self) {
        let flag = self.tcache_flag;
        for (i, m) in self.mags.iter_mut().enumerate() {
            let size = class_size(i);
            for q in m.items.drain(..) {
                // SAFETY: as in `keep`: a kept object of class i, freed once.
                unsafe { je::sdallocx(q.as_ptr().cast(), size, flag) };
            }
        }
        self.bytes = 0;
        self.show();
    }
}

/// The size of class `idx`.
fn class_size(idx: usize) -> usize {
    match idx {
        0 => 8,
        1..=4 => idx * 16,
        5..=40 => {
            let (lg, q) = (6 + (idx - 5) / 4, 5 + (idx - 5) % 4);
            q << (lg - 2)
        }
        _ => (idx - 32) * PAGE_CLASS,
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
            // SAFETY: nallocx only computes a size.
            let je_size = unsafe { je::nallocx(size, 0) };
            assert_eq!(c, je_size, "class of {size}");
            assert_eq!(class_size(idx), c, "size of class {idx}");
            if idx != last.0 {
                assert!(idx == last.0.wrapping_add(1), "classes are numbered densely ({size})");
                last = (idx, c);
            }
        }
        assert_eq!(last.0, NCLASSES - 1);
        assert!(classes_match_jemalloc());
        assert_eq!(cap_of(64), 64);
        assert_eq!(cap_of(64 << 10), 4);
        assert_eq!(cap_of(MAX_CACHED), 1);
    }
}
