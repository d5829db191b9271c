//! `Heap`: a scoped registered allocator — one jemalloc arena whose chunks are memory regions.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use tikv_jemalloc_sys as je;

use crate::error::{Error, Result};
use crate::heap::buffer::Buffer;
use crate::heap::keys::{keys_in_slot, Keys};
use crate::heap::numa::{self, NumaPolicy};
use crate::heap::owner::{take_hook_error, Owner};
use crate::heap::pagemap::SLOT;
use crate::heap::stats::HeapStats;
use crate::heap::tcache::{self, Registry};
use crate::heap::{chunk, jemalloc};
use crate::verbs::{Access, Pd};

/// Default cap on chunk size (`arena.N.retain_grow_limit`).
pub const DEFAULT_MAX_CHUNK: usize = 64 << 20;
/// jemalloc's minimum alignment on x86_64 / aarch64.
const MIN_ALIGN: usize = 16;

/// Configures a [`Heap`].
#[derive(Debug, Clone)]
pub struct HeapBuilder {
    pds: Vec<Pd>,
    access: Access,
    numa: NumaPolicy,
    hugepages: bool,
    max_chunk: usize,
    limit: Option<usize>,
}

impl HeapBuilder {
    /// Registers the heap with `pd` (call again for more PDs: multi-device registration, up to
    /// [`crate::heap::MAX_PDS`]). The first PD is the primary one: its keys are what
    /// [`Buffer::lkey`] and [`crate::keys_of`] report.
    pub fn bind(mut self, pd: &Pd) -> Self {
        self.pds.push(pd.clone());
        self
    }

    /// Access rights of every chunk's registration. Default [`Access::LOCAL_WRITE`]: remote read,
    /// write and atomics must be asked for, and only then is a heap rkey ever handed out.
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// NUMA placement (default [`NumaPolicy::DeviceLocal`]).
    pub fn numa(mut self, policy: NumaPolicy) -> Self {
        self.numa = policy;
        self
    }

    /// Advise transparent huge pages for chunks (default on; no effect where THP is off).
    pub fn hugepages(mut self, on: bool) -> Self {
        self.hugepages = on;
        self
    }

    /// Largest chunk jemalloc grows to (default 64 MiB, at least 2 MiB). Allocations larger than
    /// this still get a chunk of their own size.
    pub fn max_chunk(mut self, bytes: usize) -> Self {
        self.max_chunk = bytes;
        self
    }

    /// Cap on mapped (and so registered, pinned) bytes. Allocations that would need more fail
    /// with [`Error::LimitExceeded`].
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = Some(bytes);
        self
    }

    /// Creates the arena, binds the PDs and applies the settings.
    pub fn build(self) -> Result<Heap> {
        if self.max_chunk < SLOT {
            return Err(Error::InvalidArgument(format!("max_chunk must be at least {SLOT} bytes")));
        }
        let node = match self.numa {
            NumaPolicy::None => None,
            NumaPolicy::Node(n) => {
                numa::validate(n)?;
                Some(n)
            }
            NumaPolicy::DeviceLocal => {
                let node = self.pds.first().and_then(|pd| pd.context().numa_node());
                if node.is_none() {
                    let dev = self.pds.first().map(|pd| pd.context().name().to_string());
                    tracing::info!(
                        device = dev.as_deref().unwrap_or("(none bound)"),
                        "NumaPolicy::DeviceLocal: the device reports no NUMA node; chunks are not NUMA-bound"
                    );
                }
                node
            }
        };
        let owner = Arc::new(Owner::new(self.access, node, self.hugepages, self.limit.unwrap_or(usize::MAX)));
        for pd in &self.pds {
            owner.bind(pd)?;
        }
        let arena = jemalloc::create_arena(owner.hooks_ptr()).map_err(|e| match take_hook_error() {
            crate::heap::owner::HookError::None => e,
            hook => hook.into_error(SLOT),
        });
        let arena = match arena {
            Ok(a) => a,
            Err(e) => {
                owner.release_all();
                return Err(e);
            }
        };
        let heap =
            Heap { id: owner.id, owner, tcaches: Arc::new(Registry::default()), arena, max_chunk: self.max_chunk };
        jemalloc::write::<isize>(&format!("arena.{arena}.dirty_decay_ms"), -1)?;
        jemalloc::write::<isize>(&format!("arena.{arena}.muzzy_decay_ms"), -1)?;
        jemalloc::write::<usize>(&format!("arena.{arena}.retain_grow_limit"), self.max_chunk)?;
        Ok(heap)
    }
}

/// A registered heap: one jemalloc arena whose chunks are registered with the bound PDs.
///
/// Every byte it hands out lies in exactly one registered chunk, and its keys are found in O(1)
/// without locks ([`Heap::keys`], [`crate::keys_of`]). Buffers and collections borrow the heap, so
/// it cannot be dropped while any of them lives; dropping it flushes its thread caches, destroys
/// the arena, deregisters and unmaps every chunk.
///
/// ```no_run
/// use mralloc::heap::Heap;
/// use mralloc::verbs::{Access, Context, Pd};
///
/// let pd = Pd::new(&Context::open_default()?)?;
/// let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE).build()?;
/// let mut buf = heap.alloc(64 << 10)?;
/// buf.fill(7);
/// println!("lkey {:?} rkey {:?} at {:#x}", buf.lkey(), buf.rkey(), buf.addr());
///
/// // Any collection can live in the heap too:
/// let mut v = allocator_api2::vec::Vec::new_in(&heap);
/// v.extend_from_slice(b"registered");
/// assert!(heap.keys(v.as_ptr()).is_some());
/// # Ok::<(), mralloc::Error>(())
/// ```
///
/// A collection in the heap cannot outlive it either:
///
/// ```compile_fail,E0597
/// let v = {
///     let heap = mralloc::heap::Heap::builder().build().unwrap();
///     let mut v = allocator_api2::vec::Vec::new_in(&heap);
///     v.push(1u8);
///     v // error: `heap` does not live long enough
/// };
/// ```
///
/// Nor can a buffer be sent out of the scope that owns the heap:
///
/// ```compile_fail,E0597
/// let heap = mralloc::heap::Heap::builder().build().unwrap();
/// let buf = heap.alloc(64).unwrap();
/// std::thread::spawn(move || buf.len()); // error: `heap` does not live long enough ('static)
/// ```
pub struct Heap {
    /// Copy of `owner.id`, read on every allocation without a pointer chase.
    id: u64,
    owner: Arc<Owner>,
    tcaches: Arc<Registry>,
    arena: u32,
    max_chunk: usize,
}

impl std::fmt::Debug for Heap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heap")
            .field("arena", &self.arena)
            .field("access", &self.owner.access)
            .field("numa_node", &self.owner.numa_node())
            .field("max_chunk", &self.max_chunk)
            .finish()
    }
}

impl Heap {
    /// Starts configuring a heap.
    pub fn builder() -> HeapBuilder {
        HeapBuilder {
            pds: Vec::new(),
            access: Access::LOCAL_WRITE,
            numa: NumaPolicy::DeviceLocal,
            hugepages: true,
            max_chunk: DEFAULT_MAX_CHUNK,
            limit: None,
        }
    }

    /// A heap bound to `pd` with default settings.
    pub fn new(pd: &Pd) -> Result<Heap> {
        Heap::builder().bind(pd).build()
    }

    /// Registers every chunk the heap has, and every later one, with `pd` (late bind).
    pub fn bind(&self, pd: &Pd) -> Result<()> {
        self.owner.bind(pd).map(|_| ())
    }

    /// The jemalloc arena index.
    pub fn arena_index(&self) -> u32 {
        self.arena
    }

    /// The registration access rights.
    pub fn access(&self) -> Access {
        self.owner.access
    }

    /// The NUMA node chunks are bound to, if any.
    pub fn numa_node(&self) -> Option<u32> {
        self.owner.numa_node()
    }

    /// Allocates `len` bytes, zero-filled. A [`Buffer`] derefs to `&[u8]`, so its bytes must be
    /// initialised; jemalloc zeroes cheaply (fresh chunk pages are zero already). For raw,
    /// uninitialised memory use the `allocator_api2::alloc::Allocator` impl of `&Heap`.
    #[inline]
    pub fn alloc(&self, len: usize) -> Result<Buffer<'_>> {
        self.alloc_layout(Layout::from_size_align(len, 1).map_err(|e| Error::InvalidArgument(e.to_string()))?)
    }

    /// Same as [`Heap::alloc`] (kept for symmetry with `std::alloc`): zero-filled bytes.
    pub fn alloc_zeroed(&self, len: usize) -> Result<Buffer<'_>> {
        self.alloc(len)
    }

    /// Allocates with an explicit size and alignment (alignment up to the page size and beyond),
    /// zero-filled.
    #[inline]
    pub fn alloc_layout(&self, layout: Layout) -> Result<Buffer<'_>> {
        self.check_len(layout.size())?;
        let ptr = self.raw_alloc(layout, true)?;
        // SAFETY: ptr is a fresh allocation of layout from this heap.
        Ok(unsafe { Buffer::from_raw(ptr, layout, self) })
    }

    fn check_len(&self, len: usize) -> Result<()> {
        if len == 0 {
            return Err(Error::InvalidArgument("a buffer needs at least one byte".into()));
        }
        if len > isize::MAX as usize / 2 {
            return Err(Error::InvalidArgument(format!("{len} bytes is larger than any heap can hold")));
        }
        Ok(())
    }

    /// This thread's cache flag and live-byte counter; `true` when the counter is this thread's
    /// own (single writer), `false` for the shared fallback used while a thread exits.
    #[inline]
    fn cache(&self) -> (libc::c_int, *const AtomicI64, bool) {
        match tcache::get(self.id, &self.tcaches) {
            Some(Ok((tc, live))) => (je::MALLOCX_TCACHE(tc as usize), live, true),
            _ => (je::MALLOCX_TCACHE_NONE, &self.owner.counters.orphan_live as *const AtomicI64, false),
        }
    }

    #[inline]
    fn align_flag(layout: Layout) -> libc::c_int {
        if layout.align() > MIN_ALIGN {
            je::MALLOCX_LG_ALIGN(layout.align().trailing_zeros() as usize)
        } else {
            0
        }
    }

    /// Allocates `layout` (size > 0) from the arena through this thread's cache.
    #[inline]
    pub(crate) fn raw_alloc(&self, layout: Layout, zeroed: bool) -> Result<NonNull<u8>> {
        let (tc, live, own) = self.cache();
        let mut flags = je::MALLOCX_ARENA(self.arena as usize) | tc | Self::align_flag(layout);
        if zeroed {
            flags |= je::MALLOCX_ZERO;
        }
        // SAFETY: size > 0 (checked by callers); flags name our arena and a tcache of ours.
        let p = unsafe { je::mallocx(layout.size(), flags) };
        match NonNull::new(p.cast::<u8>()) {
            Some(p) => {
                add_live(live, own, layout.size() as i64);
                Ok(p)
            }
            None => Err(take_hook_error().into_error(layout.size())),
        }
    }

    /// Frees memory from [`Heap::raw_alloc`].
    ///
    /// # Safety
    /// `ptr` must come from `raw_alloc(layout)` on this heap and not have been freed.
    #[inline]
    pub(crate) unsafe fn raw_free(&self, ptr: NonNull<u8>, layout: Layout) {
        let (tc, live, own) = self.cache();
        // SAFETY: the caller guarantees ptr/layout come from this heap's arena; the size and
        // alignment flags match the allocation.
        unsafe { je::sdallocx(ptr.as_ptr().cast(), layout.size(), tc | Self::align_flag(layout)) };
        add_live(live, own, -(layout.size() as i64));
    }

    /// The keys of the chunk holding `ptr` for the primary PD, if this heap handed it out.
    #[inline]
    pub fn keys<T>(&self, ptr: *const T) -> Option<Keys> {
        let (_, rec) = chunk::find(ptr as usize)?;
        if rec.owner.load(Ordering::Relaxed) != self.owner.id {
            return None;
        }
        keys_in_slot(rec, 0)
    }

    /// The keys of the chunk holding `ptr` for `pd`, if this heap handed it out and is bound to
    /// `pd`.
    pub fn keys_for<T>(&self, ptr: *const T, pd: &Pd) -> Option<Keys> {
        let (_, rec) = chunk::find(ptr as usize)?;
        if rec.owner.load(Ordering::Relaxed) != self.owner.id {
            return None;
        }
        keys_in_slot(rec, self.owner.slot_of(pd)?)
    }

    /// What the heap holds and what registration cost so far.
    pub fn stats(&self) -> HeapStats {
        let live = self.tcaches.live() + self.owner.counters.orphan_live.load(Ordering::Relaxed);
        jemalloc::refresh_stats();
        HeapStats::from_owner(&self.owner, live.max(0) as u64, jemalloc::arena_allocated(self.arena))
    }

    /// Asks jemalloc to purge the arena's unused dirty pages (`arena.N.purge`). The hooks refuse:
    /// registered pages are never purged. Exposed so tests can prove it.
    pub fn purge(&self) -> Result<()> {
        jemalloc::run(&format!("arena.{}.purge", self.arena))
    }

    /// Triggers decay-based purging (`arena.N.decay`); likewise refused by the hooks.
    pub fn decay(&self) -> Result<()> {
        jemalloc::run(&format!("arena.{}.decay", self.arena))
    }
}

#[inline]
fn add_live(live: *const AtomicI64, own: bool, delta: i64) {
    // SAFETY: `live` points at a counter owned by the heap's registry (or the owner), which
    // outlives every call made through &Heap.
    let live = unsafe { &*live };
    if own {
        // This thread is the counter's only writer: a plain load + store (no locked RMW).
        live.store(live.load(Ordering::Relaxed) + delta, Ordering::Relaxed);
    } else {
        live.fetch_add(delta, Ordering::Relaxed);
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        self.tcaches.destroy_all();
        match jemalloc::run(&format!("arena.{}.destroy", self.arena)) {
            Ok(()) => self.owner.release_all(),
            Err(e) => {
                // jemalloc still references the arena's metadata inside our chunks: unmapping
                // them now would leave it dangling. Leak them instead, loudly.
                tracing::error!("arena.{}.destroy failed ({e}); leaking its registered chunks", self.arena);
            }
        }
    }
}

// SAFETY: `&Heap` hands out memory from the heap's arena; allocate/deallocate pair through the
// same arena and layout, and the memory stays valid until deallocated (the heap cannot be
// dropped while the borrowing collection lives).
unsafe impl allocator_api2::alloc::Allocator for &Heap {
    fn allocate(&self, layout: Layout) -> std::result::Result<NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        if layout.size() == 0 {
            // Zero-sized: a dangling, well-aligned pointer (never passed to jemalloc).
            let p = NonNull::new(layout.align() as *mut u8).ok_or(allocator_api2::alloc::AllocError)?;
            return Ok(NonNull::slice_from_raw_parts(p, 0));
        }
        match self.raw_alloc(layout, false) {
            Ok(p) => Ok(NonNull::slice_from_raw_parts(p, layout.size())),
            Err(e) => {
                tracing::debug!("Heap allocation of {} bytes failed: {e}", layout.size());
                Err(allocator_api2::alloc::AllocError)
            }
        }
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            // SAFETY: the Allocator contract: ptr was allocated by this allocator with layout.
            unsafe { self.raw_free(ptr, layout) };
        }
    }
}
