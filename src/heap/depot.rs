//! A scoped heap's depot: batches of free objects that one thread's front cache
//! ([`crate::heap::front`]) gave up, for any thread's front to take whole.
//!
//! When one thread allocates and another frees (a receive path handing buffers to a worker),
//! the freeing thread's magazine of a class fills up and the allocating thread's stays empty.
//! Without the depot the first hands its older half back to jemalloc one object at a time and
//! the second asks jemalloc for every object. With it, the older half goes here as one batch (a
//! copy of its pointers and a lock), and the allocating thread's empty magazine takes a batch
//! (a lock and a pointer swap): both threads stay on their magazines' fast paths, and jemalloc
//! is reached once per batch instead of twice per object.
//!
//! The depot keeps at most `limit` bytes of objects (the heap's per-thread budget,
//! [`crate::heap::HeapBuilder::thread_cache`]; the batches' own storage, 8 bytes an object
//! and 32 a batch, is not counted); a batch that does not fit goes to jemalloc, as before. A kept object is a free
//! object of its class, still allocated in jemalloc's view: [`Depot::flush`] hands everything
//! back (a refused allocation, `flush_thread_cache`, the last thread using the heap exiting);
//! the heap's teardown leaves them to the arena's destruction, which discards all it holds.
//!
//! Nothing is allocated or freed while a shelf's lock is held (a batch is linked in and out of
//! its shelf as is): the global allocator may be one that serves from this very heap.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use parking_lot::Mutex;
use tikv_jemalloc_sys as je;

use crate::heap::classes::{Class, NCLASSES};

/// A batch of free objects of one class: `items` (a `Vec` whose storage a magazine may adopt),
/// and the link to the next batch on its shelf.
pub(crate) struct Batch {
    pub(crate) items: Vec<NonNull<u8>>,
    next: Option<Box<Batch>>,
}

impl Batch {
    /// An empty batch with room for `n` objects; `None` if the memory cannot be had.
    pub(crate) fn with_capacity(n: usize) -> Option<Box<Batch>> {
        let mut items = Vec::new();
        items.try_reserve_exact(n).ok()?;
        // A Box of a few words: as fallible as any allocation of the program's.
        Some(Box::new(Batch { items, next: None }))
    }
}

/// The batches of one class: a stack linked through the batches.
#[repr(align(64))] // two classes' locks never share a cache line
struct Shelf {
    top: Mutex<Option<Box<Batch>>>,
    /// Batches on the shelf, written under the lock: a taker finds an empty shelf without
    /// locking.
    count: AtomicU32,
}

/// See the module docs.
pub(crate) struct Depot {
    shelves: [Shelf; NCLASSES],
    /// Bytes of the objects kept, reserved before a batch is shelved: at most `limit`.
    bytes: AtomicUsize,
    limit: usize,
}

// SAFETY: the pointers in the batches are free objects of the heap's arena, owned by the depot
// while shelved (no thread references them), and every access to a shelf goes through its lock.
unsafe impl Send for Depot {}
// SAFETY: as above.
unsafe impl Sync for Depot {}

impl Drop for Depot {
    fn drop(&mut self) {
        // The batches' storage (not their objects: see the module docs), one at a time rather
        // than by the links' recursive drop.
        for shelf in &self.shelves {
            let mut top = shelf.top.lock().take();
            while let Some(mut b) = top {
                top = b.next.take();
            }
        }
    }
}

impl Depot {
    pub(crate) fn new(limit: usize) -> Depot {
        Depot {
            shelves: std::array::from_fn(|_| Shelf { top: Mutex::new(None), count: AtomicU32::new(0) }),
            bytes: AtomicUsize::new(0),
            limit,
        }
    }

    /// Bytes of the objects kept now.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Reserves room for `n` objects of `class`; `false` if they would pass the depot's bound.
    /// A reservation is used by [`Depot::shelve`] or undone by [`Depot::unreserve`].
    pub(crate) fn reserve(&self, class: Class, n: usize) -> bool {
        let bytes = n * class.size();
        if n == 0 || self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes > self.limit {
            self.bytes.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Undoes [`Depot::reserve`]`(class, n)`.
    pub(crate) fn unreserve(&self, class: Class, n: usize) {
        self.bytes.fetch_sub(n * class.size(), Ordering::Relaxed);
    }

    /// Shelves `batch` (free objects of `class`, which the caller gives up), for which room
    /// was reserved.
    pub(crate) fn shelve(&self, class: Class, mut batch: Box<Batch>) {
        let shelf = &self.shelves[class.index()];
        let mut top = shelf.top.lock();
        batch.next = top.take();
        *top = Some(batch);
        shelf.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Shelves `batch` again, one [`Depot::take`] just gave out: it is kept even if others
    /// filled the depot meanwhile (past its bound by that batch at most, until it is taken).
    pub(crate) fn put_back(&self, class: Class, batch: Box<Batch>) {
        self.bytes.fetch_add(batch.items.len() * class.size(), Ordering::Relaxed);
        self.shelve(class, batch);
    }

    /// A batch of `class` (non-empty), if the depot keeps one: the caller owns its objects.
    #[inline]
    pub(crate) fn take(&self, class: Class) -> Option<Box<Batch>> {
        let shelf = &self.shelves[class.index()];
        if shelf.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let batch = {
            let mut top = shelf.top.lock();
            let mut batch = top.take()?;
            *top = batch.next.take();
            shelf.count.fetch_sub(1, Ordering::Relaxed);
            batch
        };
        self.unreserve(class, batch.items.len());
        Some(batch)
    }

    /// Hands every kept object back to jemalloc's arena (no thread cache). Each shelf is
    /// emptied at once, so batches shelved meanwhile wait for the next flush.
    pub(crate) fn flush(&self) {
        for class in Class::all() {
            let shelf = &self.shelves[class.index()];
            if shelf.count.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut top = {
                let mut top = shelf.top.lock();
                shelf.count.store(0, Ordering::Relaxed);
                top.take()
            };
            while let Some(mut batch) = top {
                top = batch.next.take();
                self.unreserve(class, batch.items.len());
                for q in &batch.items {
                    // SAFETY: a shelved object is a live allocation of exactly class.size()
                    // bytes of the heap's arena that nobody else holds (see `shelve`); taken off
                    // its shelf above, it is freed once.
                    unsafe { je::sdallocx(q.as_ptr().cast(), class.size(), je::MALLOCX_TCACHE_NONE) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::classes::cacheable_class;

    fn batch(objs: &[NonNull<u8>]) -> Box<Batch> {
        let mut b = Batch::with_capacity(objs.len()).unwrap();
        b.items.extend_from_slice(objs);
        b
    }

    #[test]
    fn keeps_batches_within_its_bytes() {
        let class = cacheable_class(64, 0).unwrap();
        let depot = Depot::new(9 * class.size());
        let objs: Vec<NonNull<u8>> = (1..=6usize).map(|i| NonNull::new((i * 64) as *mut u8).unwrap()).collect();
        assert!(depot.take(class).is_none());
        assert!(depot.reserve(class, 4));
        depot.shelve(class, batch(&objs[..4]));
        assert_eq!(depot.bytes(), 4 * class.size());
        assert!(!depot.reserve(class, 6), "6 more would pass the limit of 9");
        assert_eq!(depot.bytes(), 4 * class.size(), "a refused reservation reserves nothing");
        assert!(depot.reserve(class, 2));
        depot.shelve(class, batch(&objs[4..]));
        assert!(!depot.reserve(class, 0), "an empty batch is not kept");
        let other = cacheable_class(4096, 0).unwrap();
        assert!(depot.take(other).is_none(), "batches are per class");
        let newest = depot.take(class).unwrap();
        assert_eq!(newest.items, objs[4..].to_vec(), "the newest batch first");
        assert_eq!(depot.bytes(), 4 * class.size());
        depot.put_back(class, newest);
        assert_eq!(depot.bytes(), 6 * class.size());
        assert_eq!(depot.take(class).unwrap().items, objs[4..].to_vec());
        assert_eq!(depot.take(class).unwrap().items, objs[..4].to_vec());
        assert!(depot.take(class).is_none());
        assert_eq!(depot.bytes(), 0);
        // Dropped with batches on a shelf: their storage is freed, their (fake) objects left.
        assert!(depot.reserve(class, 2));
        depot.shelve(class, batch(&objs[..2]));
    }
}
