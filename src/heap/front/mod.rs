//! The front cache of a scoped heap: per thread, per heap, one magazine of free objects per
//! size class ([`crate::heap::classes`]), in front of jemalloc.
//!
//! jemalloc's path for an explicit arena and thread cache (`mallocx` with flags) costs several
//! times its plain `malloc`. A freed object therefore goes into the freeing thread's magazine
//! for its class, and the next allocation of that class on that thread takes it back: a thread
//! that allocates and frees RDMA buffers of the same sizes never reaches jemalloc. Objects freed
//! on another thread than the one that allocated them go into the freeing thread's magazine, as
//! jemalloc's own thread caches do: no lock on either path.
//!
//! The fast path is one store per operation on the magazine (its length), plus the thread's
//! live-byte counter: the byte budget is kept in counts. Each magazine has room for `cap`
//! objects; its room grows (doubling, up to [`cap_of`] objects: 1 MiB worth, at most
//! [`MAX_CAP`]) only on the slow path, where the room every class holds is charged against the
//! thread's budget ([`crate::heap::HeapBuilder::thread_cache`]): the bytes kept never exceed
//! the room reserved, which never exceeds the budget. Once the budget is used up, a class that
//! needs room takes back what other classes reserve but do not hold. The magazines' slot arrays
//! (8 bytes an object, from the global allocator) are charged to the same budget, and taking
//! room back from a class shrinks its array to what it holds: objects and slots together never
//! exceed the budget. A full magazine that cannot grow (at its class's most, or the budget used
//! up, if its half is worth a batch: [`MIN_HALF`]) hands its older half to the heap's depot
//! ([`crate::heap::depot`]; to jemalloc if the depot is full) and keeps the freed object; else
//! the free goes to jemalloc. An empty magazine takes a batch from the
//! depot before the allocation goes to jemalloc. The bytes kept are derived when statistics ask
//! ([`crate::heap::HeapStats::thread_cached_bytes`]). Thread exit and the heap's teardown return
//! every magazine's objects to jemalloc (the depot's: see [`crate::heap::depot`]).

use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

use tikv_jemalloc_sys as je;

use crate::heap::classes::{Class, NCLASSES};
use crate::heap::depot::Depot;

mod exchange;

/// A front's slow paths (growing or halving a magazine, taking a batch) change its magazines'
/// storage and room, and allocate or free through the global allocator on the way, which may
/// be one that serves from this very heap: while one runs, a re-entered slow path does nothing
/// (its free or allocation goes to jemalloc); the fast paths, which only push and pop within a
/// magazine's room, find every magazine whole whenever the heap can be re-entered.
struct Busy<'a>(&'a Cell<bool>);

impl<'a> Busy<'a> {
    /// `None` if `front`'s cache is off or a slow path of it is running already.
    fn enter(front: &'a Front) -> Option<Busy<'a>> {
        if front.limit == 0 || front.busy.replace(true) {
            return None;
        }
        Some(Busy(&front.busy))
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

/// Default of [`crate::heap::HeapBuilder::thread_cache`]: bytes a thread may keep per heap.
pub const DEFAULT_THREAD_CACHE: usize = 4 << 20;

/// The most objects a magazine keeps.
const MAX_CAP: usize = 2048;
/// The most bytes a magazine keeps (if the thread's budget has that much room): enough for a
/// thousand 512-byte buffers freed in a row to come back without reaching jemalloc.
const CLASS_BYTES: usize = 1 << 20;
/// The room a magazine starts with (or its class's most, if smaller).
const FIRST_CAP: usize = 8;
/// Bytes of a magazine slot (its array's element), charged to the budget with the objects.
const SLOT: usize = std::mem::size_of::<NonNull<u8>>();
/// After taking room back from other classes found none, this many frees that need room skip
/// the search (they hand a half on, or go to jemalloc) before it is tried again.
const RECLAIM_BACKOFF: u32 = 64;
/// A magazine the budget keeps from growing hands its older half to the depot only if the
/// half has this many objects, or [`MIN_HALF_BYTES`]: a batch costs a lock and two small
/// allocations (its list node and its slots), which a few small objects do not repay.
const MIN_HALF: usize = 8;
/// See [`MIN_HALF`].
const MIN_HALF_BYTES: usize = 64 << 10;

/// How many objects of `class_size` a magazine keeps at most: [`CLASS_BYTES`] worth, between 1
/// and [`MAX_CAP`].
pub(crate) const fn cap_of(class_size: usize) -> usize {
    let n = CLASS_BYTES / class_size;
    if n > MAX_CAP {
        MAX_CAP
    } else if n < 1 {
        1
    } else {
        n
    }
}

/// One class's stack of free objects: `items[..len]`, at most `cap`.
struct Magazine {
    /// `room` slots (from a `Vec`'s raw parts), or dangling while `room` is 0.
    items: Cell<*mut NonNull<u8>>,
    /// Objects kept. Written by the front's thread only; read by others for statistics.
    len: AtomicU32,
    /// Objects the magazine may hold: its share of the thread's budget (`cap <= room`).
    cap: Cell<u32>,
}

/// One thread's front cache for one heap. Only its thread changes it (through `&Front`: the
/// magazines are `Cell`s); other threads read the atomic counters (the live bytes and each
/// magazine's length), only under the heap's registry lock (which this front is freed under),
/// and flush it at teardown ([`Front::flush_all`]) when its thread is gone or can no longer use
/// the heap.
#[repr(align(128))] // the counters of two threads' fronts never share a cache line
pub(crate) struct Front {
    /// Bytes this thread handed out minus bytes it freed, for this heap. One writer (the thread,
    /// load + store); the registry sums it under its lock.
    live: AtomicI64,
    mags: [Magazine; NCLASSES],
    /// Slots allocated for each magazine's `items`.
    room: [Cell<u32>; NCLASSES],
    /// Bytes the magazines' `cap`s add up to, plus their slot arrays' (`room` x 8): at most
    /// `limit`.
    reserved: Cell<usize>,
    /// The thread's budget in bytes; 0 turns the cache off.
    limit: usize,
    /// Frees left to send past the magazines before searching for room again.
    backoff: Cell<u32>,
    /// Allocations left to send to jemalloc before taking from the depot again (after a batch
    /// the budget could not pay for).
    refill_backoff: Cell<u32>,
    /// Set while a slow path changes the magazines ([`Busy`]).
    busy: Cell<bool>,
    /// The thread's jemalloc tcache for the heap (`MALLOCX_TCACHE` flag ready to use).
    pub(crate) tcache_flag: libc::c_int,
    /// Its index (for `tcache.flush`, and `tcache.destroy` when the slot dies).
    pub(crate) tcache: u32,
    /// The heap's depot (in its registry, which outlives every front of the heap).
    depot: NonNull<Depot>,
}

impl Drop for Front {
    fn drop(&mut self) {
        for c in Class::all() {
            // The slot arrays only: the objects they point to are not owned by the slots.
            drop(self.swap_storage(c, Vec::new()));
        }
    }
}

impl Front {
    pub(crate) fn new(tcache: u32, limit: usize, depot: NonNull<Depot>) -> Front {
        Front {
            live: AtomicI64::new(0),
            mags: std::array::from_fn(|_| Magazine {
                items: Cell::new(NonNull::dangling().as_ptr()),
                len: AtomicU32::new(0),
                cap: Cell::new(0),
            }),
            room: std::array::from_fn(|_| Cell::new(0)),
            reserved: Cell::new(0),
            limit,
            backoff: Cell::new(0),
            refill_backoff: Cell::new(0),
            busy: Cell::new(false),
            tcache_flag: je::MALLOCX_TCACHE(tcache as usize),
            tcache,
            depot,
        }
    }

    #[inline(always)]
    fn depot(&self) -> &Depot {
        // SAFETY: the registry that holds the depot outlives its fronts (see `Front::depot`).
        unsafe { self.depot.as_ref() }
    }

    #[inline(always)]
    fn mag(&self, class: Class) -> &Magazine {
        // SAFETY: a Class's index is below NCLASSES (classes.rs makes no other).
        unsafe { self.mags.get_unchecked(class.index()) }
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

    /// Bytes kept (read under the registry lock): each magazine's length times its class size.
    pub(crate) fn cached(&self) -> usize {
        Class::all().map(|c| self.mag(c).len.load(Ordering::Relaxed) as usize * c.size()).sum()
    }

    /// A kept object of `class`, if any.
    #[inline(always)]
    pub(crate) fn take(&self, class: Class) -> Option<NonNull<u8>> {
        let m = self.mag(class);
        let len = m.len.load(Ordering::Relaxed).checked_sub(1)?;
        m.len.store(len, Ordering::Relaxed);
        // SAFETY: len < the old length <= room, and items[..old length] were written by `keep`.
        Some(unsafe { *m.items.get().add(len as usize) })
    }

    /// Keeps `p`, an object of `class`; `false`: not kept (the caller frees it to jemalloc).
    #[inline(always)]
    pub(crate) fn keep(&self, class: Class, p: NonNull<u8>) -> bool {
        let m = self.mag(class);
        let len = m.len.load(Ordering::Relaxed);
        if len >= m.cap.get() {
            return self.keep_slow(class, p);
        }
        // SAFETY: len < cap <= room slots.
        unsafe { m.items.get().add(len as usize).write(p) };
        m.len.store(len + 1, Ordering::Relaxed);
        true
    }

    /// [`Front::keep`] for a full magazine (`len == cap`): more room from the budget, else room
    /// other classes do not use; a magazine that cannot grow (at its class's most,
    /// [`cap_of`], or with the budget used up) hands its older half on ([`Front::halve`]) and
    /// keeps `p`; `false` if it has no room at all.
    #[cold]
    #[inline(never)]
    fn keep_slow(&self, class: Class, p: NonNull<u8>) -> bool {
        // Re-entered (the global allocator serving from this heap, called from here): the free
        // goes to jemalloc rather than change what the outer call is changing.
        let Some(_busy) = Busy::enter(self) else { return false };
        let (m, size) = (self.mag(class), class.size());
        let cap = m.cap.get() as usize;
        let most = cap_of(size);
        if cap < most {
            // Each more object costs its bytes and, if the array must grow, a slot.
            let mut spare = (self.limit - self.reserved.get()) / (size + SLOT);
            if spare == 0 && self.backoff.get() == 0 {
                spare = self.reclaim() / (size + SLOT);
                if spare == 0 {
                    self.backoff.set(RECLAIM_BACKOFF);
                }
            } else if spare == 0 {
                self.backoff.set(self.backoff.get() - 1);
            }
            let new_cap = (cap * 2).max(FIRST_CAP).min(most).min(cap + spare);
            let room = self.room[class.index()].get() as usize;
            if new_cap > cap && (room >= new_cap || self.set_room(class, new_cap)) {
                self.reserved.set(self.reserved.get() + (new_cap - cap) * size);
                m.cap.set(new_cap as u32);
                debug_assert!(self.reserved.get() <= self.limit);
                return self.keep(class, p);
            }
            // The budget is used up: a magazine whose older half is worth a batch hands it on,
            // as at its class's most; a smaller one sends this free to jemalloc.
            let half = cap.div_ceil(2);
            if half < MIN_HALF && half * size < MIN_HALF_BYTES {
                return false;
            }
        }
        self.halve(class);
        self.keep(class, p)
    }

    /// Lowers every magazine's room (its `cap` and its slot array) to what it holds, giving the
    /// rest back to the budget; returns the bytes of budget now unreserved.
    fn reclaim(&self) -> usize {
        for c in Class::all() {
            let m = self.mag(c);
            let len = m.len.load(Ordering::Relaxed);
            if m.cap.get() > len {
                self.reserved.set(self.reserved.get() - (m.cap.get() - len) as usize * c.size());
                m.cap.set(len);
            }
            if self.room[c.index()].get() > m.cap.get() {
                // If the smaller array cannot be had, the class keeps (and is charged) the old.
                self.set_room(c, m.cap.get() as usize);
            }
        }
        self.limit - self.reserved.get()
    }

    /// Gives `class`'s magazine `n` slots (0 frees the array), charging the difference to
    /// `reserved`; `false` if the memory for them cannot be had, the budget cannot pay for
    /// them, or the magazine holds more than `n` by then (the caller then goes without). No
    /// change if it has `n`. Only under [`Busy`]: the allocation and the free of the arrays may
    /// re-enter the heap, whose fast paths then find the magazine as it was, or as it is.
    fn set_room(&self, class: Class, n: usize) -> bool {
        let (m, room) = (self.mag(class), &self.room[class.index()]);
        if room.get() as usize == n {
            return true;
        }
        let mut slots = Vec::<NonNull<u8>>::new();
        if n > 0 && slots.try_reserve_exact(n).is_err() {
            return false;
        }
        // Read after the allocation, which may have re-entered the heap.
        let (old, len) = (room.get() as usize, m.len.load(Ordering::Relaxed) as usize);
        let new = slots.capacity();
        let reserved = self.reserved.get() - old * SLOT + new * SLOT;
        if len > new || (new > old && reserved > self.limit) {
            return false;
        }
        if n > 0 {
            // SAFETY: items[..len] are initialised (by `keep`); the new storage has room for
            // new >= len.
            unsafe { std::ptr::copy_nonoverlapping(m.items.get(), slots.as_mut_ptr(), len) };
        }
        let old_slots = self.swap_storage(class, slots);
        self.reserved.set(reserved);
        // Freed last, with the magazine whole again.
        drop(old_slots);
        true
    }

    /// Makes `slots` the storage of `class`'s magazine (its capacity the room) and returns the
    /// old storage as an empty `Vec`, for the caller to drop once the magazine is whole again
    /// (a free may re-enter the heap). The caller has put the magazine's objects in `slots`.
    fn swap_storage(&self, class: Class, slots: Vec<NonNull<u8>>) -> Vec<NonNull<u8>> {
        let (m, room) = (self.mag(class), &self.room[class.index()]);
        let mut slots = std::mem::ManuallyDrop::new(slots);
        // A Vec without capacity has a dangling pointer, as a new magazine does.
        let old_items = m.items.replace(slots.as_mut_ptr());
        let old_room = room.replace(slots.capacity() as u32);
        // SAFETY: `items` and `room` were a Vec's pointer and capacity (set here, or a new
        // magazine's dangling pointer and 0), no longer the magazine's; its slots own nothing.
        unsafe { Vec::from_raw_parts(old_items, 0, old_room as usize) }
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
    /// cache otherwise, and when jemalloc cannot serve a request (the limit or the device). The
    /// magazines keep their room.
    pub(crate) fn flush_all(&self) {
        // Inside a slow path (a refused allocation it made through the global allocator, which
        // served from this heap), the magazines are that path's: they stay as they are.
        let Some(_busy) = Busy::enter(self) else { return };
        for c in Class::all() {
            let m = self.mag(c);
            // Emptied, and without room, before jemalloc runs, as in `halve`.
            let cap = m.cap.replace(0);
            let len = m.len.swap(0, Ordering::Relaxed) as usize;
            // SAFETY: items[..len] were written by `keep`; the magazine no longer counts them.
            let kept = unsafe { std::slice::from_raw_parts(m.items.get(), len) };
            self.free_all(kept, c.size());
            m.cap.set(cap);
        }
    }

    /// [`Front::flush_all`], then the thread's jemalloc tcache hands its objects back to the
    /// arena too: for a request jemalloc could not serve (the heap's limit), every kept byte
    /// must be available again (the caller flushes the heap's depot too).
    pub(crate) fn flush_to_arena(&self) {
        self.flush_all();
        // Allocates nothing; it fails only for an index that is no tcache (never ours).
        let rc = crate::heap::jemalloc::tcache_flush(self.tcache);
        debug_assert_eq!(rc, 0, "tcache.flush({})", self.tcache);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps() {
        assert_eq!(cap_of(8), MAX_CAP);
        assert_eq!(cap_of(64), 2048);
        assert_eq!(cap_of(512), 2048);
        assert_eq!(cap_of(4096), 256);
        assert_eq!(cap_of(64 << 10), 16);
        assert_eq!(cap_of(crate::heap::classes::MAX_CACHED), 1);
    }
}
