//! `Heap`: a scoped registered allocator — one jemalloc arena whose chunks are memory regions.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::heap::buffer::Buffer;
use crate::heap::keys::{keys_in_slot, Keys};
use crate::heap::paths;
use crate::heap::shared::Shared;
use crate::heap::stats::HeapStats;
use crate::heap::uninit::UninitBuffer;
#[cfg(doc)]
use crate::heap::HeapBuilder;
use crate::heap::{chunk, jemalloc};
use crate::verbs::{Access, Pd};

/// A registered heap: one jemalloc arena whose chunks are registered with the bound PDs.
///
/// Every byte it hands out lies in exactly one registered chunk, and its keys are found in O(1)
/// without locks ([`Heap::keys`], [`crate::keys_of`]).
///
/// `Heap` is a cheap handle: clone it into every thread or task that allocates. [`Buffer`]s
/// have no lifetime — they can move to other threads and be freed there — and keep the heap's
/// chunks registered and mapped while they live. When the last handle and the last buffer (or
/// collection) are gone, the thread caches are flushed, the arena is destroyed and every chunk
/// is deregistered and unmapped: at once if the handle goes last, otherwise by the drop of the
/// last buffer itself, on whichever thread it happens. A buffer dropped while its thread
/// unwinds from a panic, or one whose drop raced with the last handle's, leaves that to the
/// process's liveness thread (`mralloc-liveness`, started when a heap is dropped with live
/// buffers; no thread of the heap's own): at its next round when such a drop wakes it, and within a second of
/// the drop at the latest.
///
/// `fork()`: the child reads its copies of what lives in the heap (buffers, collections) as the
/// parent had them at the fork: the kernel copies pinned pages into children (Linux 5.13+), so
/// the heap's chunks get no fork advice, and the parent keeps its pinned pages (nothing is made
/// copy-on-write). On older kernels (and where rdma-core's fork support is enabled) the chunks
/// are kept out of children (`MADV_DONTFORK`, with an inaccessible reservation in their place):
/// there a child touching them faults. In the
/// child the heap is the parent's: allocating fails with [`Error::Forked`] (an allocator-api2
/// allocation with `AllocError`), and dropping it, its buffers or its collections releases
/// nothing of it. The child may exec, use other allocators, or build a heap of its own, which
/// works as usual.
///
/// ```no_run
/// use mralloc::heap::Heap;
/// use mralloc::verbs::{Access, Context, Pd};
///
/// let pd = Pd::new(&Context::open_default()?)?;
/// let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_READ).build()?;
/// let mut buf = heap.alloc(64 << 10)?;
/// buf.fill(7);
/// println!("lkey {:?} at {:#x}", buf.lkey(), buf.addr());
/// // A read-only key for this buffer alone (a registration of its own, removed when it is
/// // freed); `buf.expose()` for one a peer may write:
/// println!("offer {:?}", buf.remote()?);
///
/// // Buffers move freely; the heap stays registered while they live.
/// let worker = std::thread::spawn(move || buf.iter().map(|&b| b as u64).sum::<u64>());
/// assert_eq!(worker.join().unwrap(), 7 * 65536);
///
/// // Any collection can live in the heap too, borrowing it or owning a handle:
/// let mut v = allocator_api2::vec::Vec::new_in(&heap);
/// v.extend_from_slice(b"registered");
/// assert!(heap.keys(v.as_ptr()).is_some());
/// let owned = allocator_api2::vec::Vec::<u8, Heap>::with_capacity_in(4096, heap.clone());
/// # drop(owned);
/// # Ok::<(), mralloc::Error>(())
/// ```
///
/// A collection that borrows the heap cannot outlive that borrow:
///
/// ```compile_fail,E0597
/// let v = {
///     let heap = mralloc::heap::Heap::builder().build().unwrap();
///     let mut v = allocator_api2::vec::Vec::new_in(&heap);
///     v.push(1u8);
///     v // error: `heap` does not live long enough
/// };
/// ```
pub struct Heap {
    pub(crate) shared: NonNull<Shared>,
    /// Copies of the record's id and arena, read on every allocation without a pointer chase.
    pub(crate) id: u64,
    pub(crate) arena: u32,
    /// The fork generation the heap was made in (a fork()ed child may not use it).
    pub(crate) born: Born,
}

// SAFETY: the shared record is thread-safe (atomics, locks, jemalloc's own thread safety); a
// handle only keeps it alive.
unsafe impl Send for Heap {}
// SAFETY: as above; every method takes &self and is safe to call concurrently.
unsafe impl Sync for Heap {}

impl Clone for Heap {
    fn clone(&self) -> Heap {
        self.shared().acquire();
        Heap { shared: self.shared, id: self.id, arena: self.arena, born: self.born }
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        if !self.born.here() {
            // A fork()ed child's copy of a parent's heap: the parent's to tear down (its data
            // chunks here are copies, or not there at all).
            return;
        }
        // SAFETY: this handle is live and is given up here, once.
        unsafe { Shared::release(self.shared) };
    }
}

impl std::fmt::Debug for Heap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.shared();
        f.debug_struct("Heap")
            .field("arena", &self.arena)
            .field("access", &s.access)
            .field("whole_chunks", &s.whole_chunks)
            .field("numa_node", &s.owner.numa_node())
            .field("max_chunk", &s.max_chunk)
            .finish()
    }
}

impl Heap {
    /// A heap bound to `pd` with default settings.
    ///
    /// # Errors
    /// As [`HeapBuilder::build`].
    pub fn new(pd: &Pd) -> Result<Heap> {
        Heap::builder().bind(pd).build()
    }

    #[inline]
    pub(crate) fn shared(&self) -> &Shared {
        // SAFETY: a handle keeps the record alive.
        unsafe { self.shared.as_ref() }
    }

    /// The record this handle keeps alive.
    #[inline(always)]
    pub(crate) fn shared_ptr(&self) -> NonNull<Shared> {
        self.shared
    }

    /// The heap's id (a copy of the record's, read without a pointer chase).
    #[inline(always)]
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The fork generation the heap was made in.
    #[inline(always)]
    pub(crate) fn born(&self) -> Born {
        self.born
    }

    /// Registers every chunk the heap has, and every later one, with `pd` (late bind; a heap
    /// built with [`HeapBuilder::register_on_first_use`] that has a primary PD registers its
    /// chunks with `pd` on their first use through it instead, reserved ones at once).
    ///
    /// If `pd`'s device is removed later (`rdma link delete`, a driver unbound, a NIC reset),
    /// the heap drops that binding by itself (at once on the kernel's device event, at the
    /// latest within 5 s of the removal): its buffers
    /// then have no keys for that PD (operations on them fail with
    /// [`Error::NotRegistered`]), the memory stays usable, and the heap can be bound again —
    /// to a PD of the device once it is back, or of another one.
    ///
    /// # Errors
    /// [`Error::Registration`] if registering an existing chunk fails (nothing is bound then;
    /// [`Error::Io`] if marking a chunk fork children need `MADV_DOFORK` after registering
    /// does),
    /// [`Error::InvalidArgument`] if the heap is bound to [`crate::heap::MAX_PDS`] PDs already,
    /// [`Error::DeviceRemoved`] if `pd`'s device was removed.
    pub fn bind(&self, pd: &Pd) -> Result<()> {
        self.shared().owner.bind_shared(pd).map(|_| ())
    }

    /// The jemalloc arena index.
    pub fn arena_index(&self) -> u32 {
        self.arena
    }

    /// The access rights the heap was built with ([`HeapBuilder::access`]).
    pub fn access(&self) -> Access {
        self.shared().access
    }

    /// The NUMA node chunks are bound to, if any.
    pub fn numa_node(&self) -> Option<u32> {
        self.shared().owner.numa_node()
    }

    /// Whether `other` is a handle to the same heap.
    pub fn same_heap(&self, other: &Heap) -> bool {
        self.shared == other.shared
    }

    /// Allocates `len` bytes, zero-filled. A [`Buffer`] derefs to `&[u8]`, so its bytes must be
    /// initialised: memory from fresh chunk pages is zero already and is not written, reused
    /// memory is zeroed. For memory the NIC fills through an owned operation (a `post_read` or
    /// `post_recv` target, an async READ or receive), use [`Heap::alloc_uninit`], which never
    /// zeroes; the blocking calls borrow initialised memory (a `Buffer`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero or absurd lengths; [`Error::LimitExceeded`],
    /// [`Error::Registration`], [`Error::Io`] or [`Error::OutOfMemory`] when a new chunk was
    /// needed and could not be mapped, bound or registered.
    #[inline]
    pub fn alloc(&self, len: usize) -> Result<Buffer> {
        self.alloc_layout(Layout::from_size_align(len, 1).map_err(|e| Error::InvalidArgument(e.to_string()))?)
    }

    /// Same as [`Heap::alloc`] (kept for symmetry with `std::alloc`): zero-filled bytes.
    ///
    /// # Errors
    /// As [`Heap::alloc`].
    pub fn alloc_zeroed(&self, len: usize) -> Result<Buffer> {
        self.alloc(len)
    }

    /// Allocates `len` bytes without initialising them: an [`UninitBuffer`], for an RDMA READ or
    /// a receive to fill (or the CPU), which then becomes a [`Buffer`] of the bytes that arrived.
    /// No zero-fill: a 1 MiB buffer costs what a 64-byte one does.
    ///
    /// # Errors
    /// As [`Heap::alloc`].
    #[inline]
    pub fn alloc_uninit(&self, len: usize) -> Result<UninitBuffer> {
        check_len(len)?;
        let layout = Layout::from_size_align(len, 1).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let ptr = self.raw_alloc(layout, false)?;
        // SAFETY: ptr is a fresh allocation of layout from this heap.
        Ok(unsafe { UninitBuffer::from_raw(ptr, layout, self.shared) })
    }

    /// Allocates with an explicit size and alignment (alignment up to the page size and beyond),
    /// zero-filled.
    ///
    /// # Errors
    /// As [`Heap::alloc`].
    #[inline]
    pub fn alloc_layout(&self, layout: Layout) -> Result<Buffer> {
        check_len(layout.size())?;
        let ptr = self.raw_alloc(layout, true)?;
        // SAFETY: ptr is a fresh allocation of layout from this heap.
        Ok(unsafe { Buffer::from_raw(ptr, layout, self.shared) })
    }

    /// Allocates `layout` (size > 0): from this thread's front cache when it keeps an object of
    /// the size class, else from the heap's depot or the arena through this thread's tcache.
    #[inline(always)]
    pub(crate) fn raw_alloc(&self, layout: Layout, zeroed: bool) -> Result<NonNull<u8>> {
        self.born.check("this heap")?;
        match paths::take_cached(self, layout, zeroed) {
            Some(p) => Ok(p),
            None => paths::alloc_any(self, layout, zeroed),
        }
    }

    /// The keys of the chunk holding `ptr` for the primary PD, if this heap handed it out.
    #[inline]
    pub fn keys<T>(&self, ptr: *const T) -> Option<Keys> {
        keys_in(self.shared(), ptr.cast())
    }

    /// The keys of the chunk holding `ptr` for `pd`, if this heap handed it out and is bound to
    /// `pd` (registering the chunk with `pd` now if the heap registers on first use and had
    /// not: [`crate::heap::HeapBuilder::register_on_first_use`]; `None` if that fails).
    pub fn keys_for<T>(&self, ptr: *const T, pd: &Pd) -> Option<Keys> {
        keys_for_in(self.shared(), ptr.cast(), pd)
    }

    /// What the heap holds and what registration cost so far.
    ///
    /// In a fork()ed child (the heap is the parent's) the live and thread-cache figures read
    /// zero if a parent thread held the caches' lock at the fork.
    pub fn stats(&self) -> HeapStats {
        let s = self.shared();
        let (fronts, cached, depot) = if s.born.here() {
            s.tcaches.live_and_cached()
        } else {
            s.tcaches.try_live_and_cached().unwrap_or((0, 0, 0))
        };
        let live = fronts + s.owner.counters.orphan_live.load(Ordering::Acquire);
        jemalloc::refresh_stats();
        let mut stats = HeapStats::from_owner(&s.owner, live.max(0) as u64, jemalloc::arena_allocated(self.arena));
        stats.thread_cached_bytes = cached;
        stats.depot_bytes = depot;
        stats
    }

    /// Asks jemalloc to purge the arena's unused dirty pages now (`arena.N.purge`). Registered
    /// pages are never purged; with idle release on ([`HeapBuilder::idle_release`]) every chunk
    /// left wholly free is released at once (deregistered, then its pages dropped), as if its
    /// interval had passed. Exposed so tests can prove both.
    ///
    /// # Errors
    /// [`Error::Jemalloc`] if the mallctl fails.
    pub fn purge(&self) -> Result<()> {
        jemalloc::run(&format!("arena.{}.purge", self.arena))
    }

    /// Hands the calling thread's cached buffers of this heap
    /// ([`HeapBuilder::thread_cache`](crate::heap::HeapBuilder::thread_cache)), and jemalloc's
    /// thread cache for it, back to the heap, as the thread's exit would, and the batches the
    /// heap's depot keeps for all threads ([`HeapStats::depot_bytes`]): for a thread that
    /// goes quiet (a worker parked for a while), so that what it keeps neither holds chunks
    /// back from idle release ([`HeapBuilder::idle_release`](crate::heap::HeapBuilder::idle_release))
    /// nor counts against the heap's limit. The cache fills again with the thread's next frees.
    /// Other threads' caches are theirs to flush.
    ///
    /// # Errors
    /// [`Error::Forked`] in a fork()ed child (the heap is the parent's).
    pub fn flush_thread_cache(&self) -> Result<()> {
        self.born.check("this heap")?;
        if let Some(front) = crate::heap::tcache::existing(self.id, self.shared().registry()) {
            // SAFETY: this thread's own front for the heap, which the handle keeps alive; no
            // other reference to it is in use on this thread during the call.
            unsafe { front.as_ref() }.flush_to_arena();
        }
        self.shared().registry().depot().flush();
        Ok(())
    }

    /// Runs jemalloc's decay now (`arena.N.decay`), which otherwise runs as a side effect of
    /// allocations and frees: blocks freed at least the idle interval ago are released (see
    /// [`HeapBuilder::idle_release`]). A free is taken in at the first run after it, so a heap
    /// gone quiet gives its chunks back after two calls: one after the frees, one after the
    /// interval.
    ///
    /// # Errors
    /// [`Error::Jemalloc`] if the mallctl fails.
    pub fn decay(&self) -> Result<()> {
        jemalloc::run(&format!("arena.{}.decay", self.arena))
    }
}

/// How many heaps were dropped while buffers of theirs still live (each is torn down when the
/// last of those buffers is freed: see [`Heap`]). For tests and diagnostics.
pub fn draining_heaps() -> usize {
    crate::heap::shared::draining()
}

fn check_len(len: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::InvalidArgument("a buffer needs at least one byte".into()));
    }
    if len > isize::MAX as usize / 2 {
        return Err(Error::InvalidArgument(format!("{len} bytes is larger than any heap can hold")));
    }
    Ok(())
}

/// Keys of `ptr` (primary PD) if the heap behind `s` handed it out.
#[inline]
pub(crate) fn keys_in(s: &Shared, ptr: *const u8) -> Option<Keys> {
    let (_, rec) = chunk::find(ptr as usize)?;
    if rec.owner.load(Ordering::Relaxed) != s.id {
        return None;
    }
    keys_in_slot(rec, 0)
}

/// Keys of `ptr` for `pd` if the heap behind `s` handed it out and is bound to `pd`.
pub(crate) fn keys_for_in(s: &Shared, ptr: *const u8, pd: &Pd) -> Option<Keys> {
    if !s.born.here() {
        return None; // the parent's registrations (and `bound` may have been held at the fork)
    }
    let (_, rec) = chunk::find(ptr as usize)?;
    if rec.owner.load(Ordering::Relaxed) != s.id {
        return None;
    }
    let slot = s.owner.slot_of(pd)?;
    if let Some(keys) = keys_in_slot(rec, slot) {
        return Some(keys);
    }
    if !s.owner.first_use {
        return None;
    }
    // Not yet used through `pd` (`heap::lazy`): registered now.
    keys_in_slot(rec, s.owner.register_first_use(rec, pd, ptr as u64).ok()?)
}
