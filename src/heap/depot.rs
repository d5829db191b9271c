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
//! [`crate::heap::HeapBuilder::thread_cache`]); a batch that does not fit goes to jemalloc, as
//! before. A kept object is a free object of its class, still allocated in jemalloc's view:
//! [`Depot::flush`] hands everything back (a failed allocation, a thread's `flush_thread_cache`);
//! the heap's teardown leaves them to the arena's destruction, which discards all it holds.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use parking_lot::Mutex;
use tikv_jemalloc_sys as je;

use crate::heap::classes::{Class, NCLASSES};

/// A batch of free objects of one class (a `Vec` whose storage a magazine may adopt).
pub(crate) type Batch = Vec<NonNull<u8>>;

/// The batches of one class.
struct Shelf {
    batches: Mutex<Vec<Batch>>,
    /// `batches.len()`, written under the lock: a taker finds an empty shelf without locking.
    count: AtomicU32,
}

/// See the module docs.
pub(crate) struct Depot {
    shelves: [Shelf; NCLASSES],
    /// Bytes of the objects kept (reserved before a batch is shelved): at most `limit`.
    bytes: AtomicUsize,
    limit: usize,
}

// SAFETY: the pointers in the batches are free objects of the heap's arena, owned by the depot
// while shelved (no thread references them), and every access goes through a shelf's lock.
unsafe impl Send for Depot {}
// SAFETY: as above.
unsafe impl Sync for Depot {}

impl Depot {
    pub(crate) fn new(limit: usize) -> Depot {
        Depot {
            shelves: std::array::from_fn(|_| Shelf { batches: Mutex::new(Vec::new()), count: AtomicU32::new(0) }),
            bytes: AtomicUsize::new(0),
            limit,
        }
    }

    /// Bytes of the objects kept now.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Shelves `objects` (free objects of `class`, which the caller gives up) as one batch;
    /// `false` (nothing kept: the caller still owns them) if they do not fit in the depot's
    /// bytes or the batch's memory cannot be had.
    pub(crate) fn put(&self, class: Class, objects: &[NonNull<u8>]) -> bool {
        let bytes = objects.len() * class.size();
        if objects.is_empty() || self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes > self.limit {
            self.bytes.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        let mut batch = Batch::new();
        if batch.try_reserve_exact(objects.len()).is_err() {
            self.bytes.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        batch.extend_from_slice(objects);
        let shelf = &self.shelves[class.index()];
        let mut batches = shelf.batches.lock();
        batches.push(batch);
        shelf.count.store(batches.len() as u32, Ordering::Relaxed);
        true
    }

    /// A batch of `class` (non-empty), if the depot keeps one: the caller owns its objects.
    #[inline]
    pub(crate) fn take(&self, class: Class) -> Option<Batch> {
        let shelf = &self.shelves[class.index()];
        if shelf.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let batch = {
            let mut batches = shelf.batches.lock();
            let batch = batches.pop();
            shelf.count.store(batches.len() as u32, Ordering::Relaxed);
            batch?
        };
        self.bytes.fetch_sub(batch.len() * class.size(), Ordering::Relaxed);
        Some(batch)
    }

    /// Hands every kept object back to jemalloc's arena (no thread cache): an allocation
    /// jemalloc could not serve, a thread flushing what it keeps.
    pub(crate) fn flush(&self) {
        for class in Class::all() {
            while let Some(batch) = self.take(class) {
                for q in &batch {
                    // SAFETY: a shelved object is a live allocation of exactly class.size() bytes
                    // of the heap's arena that nobody else holds (see `put`); taken off its shelf
                    // above, it is freed once.
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

    #[test]
    fn keeps_batches_within_its_bytes() {
        let class = cacheable_class(64, 0).unwrap();
        let depot = Depot::new(9 * class.size());
        let objs: Vec<NonNull<u8>> = (1..=6usize).map(|i| NonNull::new((i * 64) as *mut u8).unwrap()).collect();
        assert!(depot.take(class).is_none());
        assert!(depot.put(class, &objs[..4]));
        assert_eq!(depot.bytes(), 4 * class.size());
        assert!(!depot.put(class, &objs), "6 more would pass the limit of 9");
        assert_eq!(depot.bytes(), 4 * class.size(), "a refused batch reserves nothing");
        assert!(depot.put(class, &objs[4..]));
        assert!(!depot.put(class, &[]), "an empty batch is not kept");
        let other = cacheable_class(4096, 0).unwrap();
        assert!(depot.take(other).is_none(), "batches are per class");
        assert_eq!(depot.take(class).unwrap(), objs[4..].to_vec(), "the newest batch first");
        assert_eq!(depot.take(class).unwrap(), objs[..4].to_vec());
        assert!(depot.take(class).is_none());
        assert_eq!(depot.bytes(), 0);
    }
}
