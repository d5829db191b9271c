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

use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use tikv_jemalloc_sys as je;

/// The largest size the front caches.
pub(crate) const MAX_CACHED: usize = 1 << 20;
/// Size classes up to [`MAX_CACHED`]: 8, 16, 32, 48, 64, then four per doubling up to 1 MiB.
pub(crate) const NCLASSES: usize = class_of(MAX_CACHED).0 + 1;
/// Default of [`crate::heap::HeapBuilder::thread_cache`]: bytes a thread may keep per heap.
pub const DEFAULT_THREAD_CACHE: usize = 4 << 20;

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

/// The size a scoped heap asks jemalloc for, and frees with, for a request of `size` bytes
/// (> 0) with alignment flag `align_flag`: the class size for what a front cache could keep, the
/// size itself otherwise. Independent of the thread's front (or its absence), so memory
/// allocated on one thread is freed with the same size on any other.
#[inline(always)]
pub(crate) fn alloc_size(size: usize, align_flag: libc::c_int) -> usize {
    cacheable_class(size, align_flag).map_or(size, |(_, class)| class)
}

/// The class (index, size) of a request a front cache could keep (up to [`MAX_CACHED`] bytes,
/// no alignment flag); `None` for any other. The one rule both [`alloc_size`] and
/// [`Front::class_for`] follow.
#[inline(always)]
fn cacheable_class(size: usize, align_flag: libc::c_int) -> Option<(usize, usize)> {
    (align_flag == 0 && size <= MAX_CACHED).then(|| class_fast(size))
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

/// The most objects a magazine keeps.
const MAX_CAP: usize = 64;

/// How many objects of `class_size` a magazine keeps: 256 KiB worth, between 1 and [`MAX_CAP`].
pub(crate) const fn cap_of(class_size: usize) -> usize {
    let n = (256 << 10) / class_size;
    if n > MAX_CAP {
        MAX_CAP
    } else if n < 1 {
        1
    } else {
        n
    }
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

/// [`class_of`], through [`SMALL_INDEX`] up to 4 KiB.
#[inline(always)]
fn class_fast(size: usize) -> (usize, usize) {
    if size <= SMALL_MAX {
        let idx = SMALL_INDEX[(size + 7) >> 3] as usize;
        (idx, CLASS_SIZE[idx])
    } else {
        class_of(size)
    }
}

/// One class's stack of free objects: `items[..len]`, at most `cap`.
struct Magazine {
    items: *mut NonNull<u8>,
    len: Cell<u32>,
    cap: u32,
}

/// One thread's front cache for one heap. Only its thread changes it (through `&Front`: the
/// magazines are `Cell`s); other threads read the two atomic counters, only under the heap's
/// registry lock (which this front is freed under), and flush it at teardown
/// ([`Front::flush_all`]) when its thread is gone or can no longer use the heap.
#[repr(align(128))] // the counters of two threads' fronts never share a cache line
pub(crate) struct Front {
    /// Bytes this thread handed out minus bytes it freed, for this heap. One writer (the thread,
    /// load + store); the registry sums it under its lock.
    live: AtomicI64,
    /// Bytes kept in the magazines (one writer, read for statistics).
    bytes: AtomicUsize,
    /// The bound on `bytes`; 0 turns the cache off.
    limit: usize,
    /// The thread's jemalloc tcache for the heap (`MALLOCX_TCACHE` flag ready to use).
    pub(crate) tcache_flag: libc::c_int,
    /// Its index (for `tcache.flush`, and `tcache.destroy` when the slot dies).
    pub(crate) tcache: u32,
    mags: Box<[Magazine]>,
    /// The storage every magazine's `items` points into: owned through this raw pointer (from
    /// `Box::into_raw`, freed in `Drop`), so that moving the front does not retag it.
    slots: NonNull<[NonNull<u8>]>,
}

impl Drop for Front {
    fn drop(&mut self) {
        // SAFETY: `slots` came from Box::into_raw in `new` and is freed only here.
        drop(unsafe { Box::from_raw(self.slots.as_ptr()) });
    }
}

impl Front {
    pub(crate) fn new(tcache: u32, limit: usize) -> Front {
        // A disabled cache (bound 0) has no magazines: `class_for` sends everything past it.
        let n = if limit == 0 { 0 } else { NCLASSES };
        let total: usize = (0..n).map(|i| cap_of(class_size(i))).sum();
        let slots = NonNull::from(Box::leak(vec![NonNull::<u8>::dangling(); total].into_boxed_slice()));
        let base = slots.as_ptr().cast::<NonNull<u8>>();
        let mut at = 0;
        let mags = (0..n)
            .map(|i| {
                let cap = cap_of(class_size(i));
                // SAFETY: at + cap <= total: the caps are summed in the same order.
                let items = unsafe { base.add(at) };
                at += cap;
                Magazine { items, len: Cell::new(0), cap: cap as u32 }
            })
            .collect();
        Front {
            live: AtomicI64::new(0),
            bytes: AtomicUsize::new(0),
            limit,
            tcache_flag: je::MALLOCX_TCACHE(tcache as usize),
            tcache,
            mags,
            slots,
        }
    }

    /// The class (index, size) under which this cache serves a request of `size` bytes whose
    /// jemalloc alignment flag is `align_flag`; `None`: not cached, the request takes the plain
    /// path (where it is still allocated as [`alloc_size`]). A disabled cache (bound 0) serves
    /// nothing.
    #[inline(always)]
    pub(crate) fn class_for(&self, size: usize, align_flag: libc::c_int) -> Option<(usize, usize)> {
        if self.limit == 0 {
            return None;
        }
        cacheable_class(size, align_flag)
    }

    /// This thread's live-byte counter, for [`add_live`].
    #[inline(always)]
    pub(crate) fn live_counter(&self) -> *const AtomicI64 {
        &self.live
    }

    /// This thread's live bytes (read under the registry lock).
    pub(crate) fn live(&self) -> i64 {
        self.live.load(Ordering::Acquire)
    }

    /// Bytes kept (read under the registry lock).
    pub(crate) fn cached(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    #[inline(always)]
    fn add_bytes(&self, delta: isize) {
        self.bytes.store(self.bytes.load(Ordering::Relaxed).wrapping_add_signed(delta), Ordering::Relaxed);
    }

    /// A kept object of class `idx` (of `class_size` bytes), if any.
    #[inline(always)]
    pub(crate) fn take(&self, idx: usize, class_size: usize) -> Option<NonNull<u8>> {
        let m = &self.mags[idx];
        let len = m.len.get().checked_sub(1)?;
        m.len.set(len);
        // SAFETY: len < cap, and items[..=len] were written by `keep`.
        let p = unsafe { *m.items.add(len as usize) };
        self.add_bytes(-(class_size as isize));
        Some(p)
    }

    /// Keeps `p`, an object of class `idx`; gives it back if the cache is full (the caller frees
    /// it to jemalloc). A full magazine first hands half of its objects back to jemalloc.
    #[inline(always)]
    pub(crate) fn keep(&self, idx: usize, class_size: usize, p: NonNull<u8>) -> Option<NonNull<u8>> {
        if self.bytes.load(Ordering::Relaxed) + class_size > self.limit {
            return Some(p);
        }
        let m = &self.mags[idx];
        if m.len.get() >= m.cap {
            self.halve(m, class_size);
        }
        let len = m.len.get();
        // SAFETY: len < cap after `halve`, and items has cap slots.
        unsafe { m.items.add(len as usize).write(p) };
        m.len.set(len + 1);
        self.add_bytes(class_size as isize);
        None
    }

    /// Hands the older half of a full magazine (the bottom of the stack) back to jemalloc, and
    /// keeps the recently freed.
    #[cold]
    #[inline(never)]
    fn halve(&self, m: &Magazine, class_size: usize) {
        let (len, out) = (m.len.get() as usize, m.cap.div_ceil(2) as usize);
        let mut victims = [NonNull::<u8>::dangling(); MAX_CAP];
        // The magazine is settled before jemalloc runs (nothing it calls may see a stale one).
        // SAFETY: out <= len <= cap <= MAX_CAP; both ranges lie in items[..len].
        unsafe {
            std::ptr::copy_nonoverlapping(m.items, victims.as_mut_ptr(), out);
            std::ptr::copy(m.items.add(out), m.items, len - out);
        }
        m.len.set((len - out) as u32);
        self.add_bytes(-((out * class_size) as isize));
        self.free_all(&victims[..out], class_size);
    }

    /// Frees objects of `class_size` bytes that left their magazine.
    fn free_all(&self, objects: &[NonNull<u8>], class_size: usize) {
        for q in objects {
            // SAFETY: a kept object is a live allocation of exactly class_size bytes from this
            // heap's arena (mallocx(class_size) or a request of that class); it left the magazine
            // before this call, so it is freed once.
            unsafe { je::sdallocx(q.as_ptr().cast(), class_size, self.tcache_flag) };
        }
    }

    /// Hands every kept object back to jemalloc (through the thread's tcache, which the caller
    /// destroys next). Called at thread exit or heap teardown, when no thread can reach this
    /// cache otherwise, and when jemalloc cannot serve a request (the limit or the device).
    pub(crate) fn flush_all(&self) {
        let mut victims = [NonNull::<u8>::dangling(); MAX_CAP];
        for (i, m) in self.mags.iter().enumerate() {
            // Emptied before jemalloc runs, as in `halve`.
            let len = m.len.replace(0) as usize;
            // SAFETY: len <= cap <= MAX_CAP, items[..len] were written by `keep`.
            unsafe { std::ptr::copy_nonoverlapping(m.items, victims.as_mut_ptr(), len) };
            self.add_bytes(-((len * class_size(i)) as isize));
            self.free_all(&victims[..len], class_size(i));
        }
    }

    /// [`Front::flush_all`], then the thread's jemalloc tcache hands its objects back to the
    /// arena too: for a request jemalloc could not serve (the heap's limit), every kept byte
    /// must be available again.
    pub(crate) fn flush_to_arena(&self) {
        self.flush_all();
        if let Err(e) = crate::heap::jemalloc::write::<libc::c_uint>("tcache.flush", self.tcache) {
            tracing::debug!("tcache.flush({}) failed: {e}", self.tcache);
        }
    }
}

/// Adds `delta` to a thread's live bytes (from [`Front::live_counter`]), through a raw pointer:
/// the release store publishes a free to the thread that sums the counters at teardown, and
/// after it the heap, and the front, may be gone (no reference to either may be live across it).
///
/// # Safety
/// `live` is the calling thread's own counter (it is the only writer), alive until this store.
#[inline(always)]
pub(crate) unsafe fn add_live(live: *const AtomicI64, delta: i64) {
    // SAFETY: the caller's contract.
    let live = unsafe { &*live };
    // The only writer: a plain load + store, no locked read-modify-write.
    live.store(live.load(Ordering::Relaxed) + delta, Ordering::Release);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_jemallocs() {
        let mut last = (usize::MAX, 0);
        for size in 1..=MAX_CACHED {
            let (idx, c) = class_of(size);
            assert_eq!(class_fast(size), (idx, c), "lookup table at {size}");
            assert_eq!(alloc_size(size, 0), c, "allocation size of {size}");
            assert_eq!(class_size(idx), c, "size of class {idx}");
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
        assert_eq!(alloc_size(MAX_CACHED + 1, 0), MAX_CACHED + 1, "past the front: as asked");
        assert_eq!(alloc_size(100, 4), 100, "an alignment flag: as asked");
        assert_eq!(cap_of(64), 64);
        assert_eq!(cap_of(64 << 10), 4);
        assert_eq!(cap_of(MAX_CACHED), 1);
    }
}
