//! The state a heap's extent hooks work with: bound PDs, placement, limits and counters.
//!
//! `Owner` is `#[repr(C)]` with jemalloc's `extent_hooks_t` as its first field, so the hooks
//! pointer jemalloc passes back to every hook call *is* a pointer to the owner.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use std::sync::Mutex;
use tikv_jemalloc_sys::extent_hooks_t;

use crate::fork::Born;
use crate::heap::bound::{self, BoundGuard};
use crate::heap::chunk::{self, MAX_PDS};
use crate::heap::hook_error::{HookError, Registering};
use crate::heap::hooks;
use crate::heap::numa;
use crate::verbs::removal::Subscription;
use crate::verbs::{Access, Pd};

/// The PDs an owner is bound to, by slot (slot 0 is the primary PD).
pub(crate) struct Bound {
    pub(crate) pds: [Option<Pd>; MAX_PDS],
}

/// Counters, all relaxed atomics.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) chunks: AtomicU64,
    pub(crate) mapped: AtomicU64,
    /// Of `mapped`, bytes that look like jemalloc's own metadata (never registered).
    pub(crate) meta: AtomicU64,
    pub(crate) registered: [AtomicU64; MAX_PDS],
    pub(crate) reg_calls: AtomicU64,
    pub(crate) reg_nanos: AtomicU64,
    pub(crate) reg_failures: AtomicU64,
    /// Of `reg_calls`, chunks registered on their first use through a PD (`heap::lazy`).
    pub(crate) first_use_regs: AtomicU64,
    /// Live bytes freed or allocated outside any thread cache slot (thread exit).
    pub(crate) orphan_live: AtomicI64,
    /// Chunks (and their bytes) released as idle now, and releases so far (`heap::idle`).
    pub(crate) idle_chunks: AtomicU64,
    pub(crate) idle_bytes: AtomicU64,
    pub(crate) idle_releases: AtomicU64,
}

/// Owner of a set of chunks: a scoped heap, or the global allocator.
#[repr(C)]
pub(crate) struct Owner {
    /// Must stay the first field: jemalloc hands this pointer back to the hooks.
    pub(crate) hooks: extent_hooks_t,
    pub(crate) id: u64,
    /// A fork()ed child registers nothing for (and never binds) an owner its parent made.
    pub(crate) born: Born,
    pub(crate) bound: Mutex<Bound>,
    /// Per PD slot, the device-removal watch of that PD's device. Only touched under
    /// `binding` and never under `bound` (dropping one takes the monitor's lock, which may
    /// allocate).
    pub(super) watches: Mutex<[Option<Subscription>; MAX_PDS]>,
    /// Held for a whole bind or removal unbind (slot and watch stay paired). Never taken by
    /// the hooks; taken before `bound`.
    pub(super) binding: Mutex<()>,
    pub(crate) access: Access,
    /// NUMA node to bind new chunks to; u32::MAX = none.
    pub(crate) numa_node: AtomicU32,
    pub(crate) hugepages: bool,
    /// Prepare data chunks for fork() children as registered memory (scoped heaps:
    /// `fork::advise_fork`, which keeps them out of children on kernels that do not copy pinned
    /// pages); the global allocator cannot keep its chunks out (every allocation lives there),
    /// and marks them `MADV_DOFORK` after registering them (`chunk::keep_in_children`).
    /// Metadata is never registered, so nothing marks it.
    pub(crate) dontfork: bool,
    /// Note a `tracing` event for each new chunk, emitted after jemalloc returns (scoped heaps,
    /// see events.rs). Not for the global allocator, whose every allocation may be the one
    /// that made the chunk: nothing emits them there.
    pub(crate) trace_chunks: bool,
    pub(crate) limit: usize,
    /// Register chunks with the PDs after the primary one on first use, not when mapped
    /// (`heap::lazy`). Set before the owner is shared.
    pub(crate) first_use: bool,
    /// The idle interval as jemalloc's `dirty_decay_ms` (-1: off; see `heap::idle`).
    pub(crate) idle_ms: AtomicI64,
    /// `Heap::reserve` calls running: chunks made meanwhile are never released.
    pub(crate) reserving: AtomicU32,
    pub(crate) counters: Counters,
}

static NEXT_OWNER_ID: AtomicU64 = AtomicU64::new(1);
/// The global allocator's owner id (never handed out by `NEXT_OWNER_ID`).
#[cfg(feature = "global")]
const STATIC_ID: u64 = u64::MAX;

impl Owner {
    /// `idle_ms`: the idle interval as `dirty_decay_ms` (-1: off; see `heap::idle`).
    pub(crate) fn new(access: Access, numa_node: Option<u32>, hugepages: bool, limit: usize, idle_ms: i64) -> Owner {
        // Decided here, outside jemalloc's hooks (the first answer may allocate: it reads the
        // environment and asks rdma-core), before the arena exists.
        crate::fork::children_copy_pinned_pages();
        Owner {
            hooks: hooks::HOOKS,
            id: NEXT_OWNER_ID.fetch_add(1, Ordering::Relaxed),
            born: Born::now(),
            bound: Mutex::new(Bound { pds: [const { None }; MAX_PDS] }),
            watches: Mutex::new([const { None }; MAX_PDS]),
            binding: Mutex::new(()),
            access,
            numa_node: AtomicU32::new(numa_node.unwrap_or(u32::MAX)),
            hugepages,
            dontfork: true,
            trace_chunks: true,
            limit,
            first_use: false,
            idle_ms: AtomicI64::new(idle_ms),
            reserving: AtomicU32::new(0),
            counters: Counters::default(),
        }
    }

    /// Whether this is the global allocator's owner (`Owner::new_static`, feature `global`).
    pub(crate) fn is_static(&self) -> bool {
        #[cfg(feature = "global")]
        return self.id == STATIC_ID;
        #[cfg(not(feature = "global"))]
        false
    }

    /// `const` form for the global allocator (no NUMA binding, not kept out of fork children, no limit).
    #[cfg(feature = "global")]
    pub(crate) const fn new_static(access: Access) -> Owner {
        Owner {
            hooks: hooks::HOOKS,
            id: STATIC_ID,
            born: Born::FIRST,
            bound: Mutex::new(Bound { pds: [const { None }; MAX_PDS] }),
            watches: Mutex::new([const { None }; MAX_PDS]),
            binding: Mutex::new(()),
            access,
            numa_node: AtomicU32::new(u32::MAX),
            hugepages: true,
            dontfork: false,
            trace_chunks: false,
            limit: usize::MAX,
            first_use: false,
            idle_ms: AtomicI64::new(-1), // set by `Global::new`
            reserving: AtomicU32::new(0),
            counters: Counters {
                chunks: AtomicU64::new(0),
                mapped: AtomicU64::new(0),
                meta: AtomicU64::new(0),
                registered: [const { AtomicU64::new(0) }; MAX_PDS],
                reg_calls: AtomicU64::new(0),
                reg_nanos: AtomicU64::new(0),
                reg_failures: AtomicU64::new(0),
                first_use_regs: AtomicU64::new(0),
                orphan_live: AtomicI64::new(0),
                idle_chunks: AtomicU64::new(0),
                idle_bytes: AtomicU64::new(0),
                idle_releases: AtomicU64::new(0),
            },
        }
    }

    pub(crate) fn numa_node(&self) -> Option<u32> {
        match self.numa_node.load(Ordering::Relaxed) {
            u32::MAX => None,
            n => Some(n),
        }
    }

    /// The pointer to give jemalloc as this owner's `extent_hooks_t *`.
    pub(crate) fn hooks_ptr(&self) -> *mut extent_hooks_t {
        self as *const Owner as *mut extent_hooks_t
    }

    /// Maps, binds, registers and publishes a new chunk. Runs inside the alloc hook: it must not
    /// allocate through any heap, panic, or block on anything jemalloc may hold.
    ///
    /// `looks_like_metadata` is base_map's exact arguments: 2 MiB alignment, zero and commit
    /// requested — mralloc never asks jemalloc to zero a 2 MiB-aligned request (it zeroes those
    /// itself), so no extent of its callers matches (only a direct `mallocx` with
    /// `MALLOCX_ZERO` and a 2 MiB alignment on one of its arenas would: that memory would have
    /// no keys, and operations on it fail with `NotRegistered`). Metadata is never registered
    /// (a registration pins the whole block where jemalloc touches a few pages: 2 MiB for each
    /// of `Global`'s `opt.narenas` arenas), refuses transparent huge pages (`MADV_NOHUGEPAGE`:
    /// under THP `always` the first touch would make all of it resident), and is not excluded
    /// from fork children (jemalloc's fork handlers touch it).
    pub(crate) fn new_chunk(
        &self,
        size: usize,
        align: usize,
        looks_like_metadata: bool,
        uncommitted: bool,
    ) -> std::result::Result<usize, HookError> {
        let meta = looks_like_metadata;
        if !self.born.here() {
            return self.new_chunk_unregistered(size, align, meta, uncommitted);
        }
        let bound = self.lock_bound();
        let mapped = self.counters.mapped.load(Ordering::Relaxed) as usize;
        if mapped.saturating_add(size) > self.limit {
            return Err(HookError::Limit { limit: self.limit, mapped, requested: size });
        }
        let started = Instant::now();
        let base = chunk::map(size, align).map_err(HookError::Map)?;
        if let Some(node) = self.numa_node() {
            if let Err(e) = numa::bind(base, size, node) {
                chunk::unmap(base, size);
                return Err(HookError::Numa(e));
            }
        }
        // Huge pages only where they pay: data chunks of a heap bound to a device (fewer pages
        // to pin per registration). Not for metadata (a 2 MiB base block would turn resident
        // whole at its first touch: 8 automatic arenas, 16 MiB that plain jemalloc does not
        // have), nor for an unbound heap — an unbound `Global` is a process's plain allocator,
        // and with THP's `defrag=madvise` every advised fault may compact memory synchronously
        // (measured: a serde_json round trip 2x slower than jemalloc with the advice).
        let huge = self.hugepages && !meta && bound.pds.iter().any(Option::is_some);
        if let Err(e) = chunk::advise(base, size, huge, self.dontfork && !meta, meta) {
            chunk::unmap(base, size);
            return Err(HookError::Advise(e));
        }
        let mapped_in = started.elapsed();
        // Read once: whether the chunk is kept (`Heap::reserve`) decides its registrations too.
        let kept = self.reserving.load(Ordering::Acquire) > 0;
        let mut mrs = [std::ptr::null_mut(); MAX_PDS];
        let mut registered_in = std::time::Duration::ZERO;
        for (slot, pd) in bound.pds.iter().enumerate() {
            // A removed device's PD is about to be unbound (`unbind_removed`): registering with
            // it may fail (a disassociated context) and would fail the allocation.
            let Some(pd) = pd.as_ref().filter(|pd| !pd.context().is_removed()) else { continue };
            if !self.registers_at_map(slot, kept, meta) {
                continue; // registered on its first use through that PD (`heap::lazy`)
            }
            let t = Instant::now();
            match chunk::register(pd.as_raw(), base, size, self.registration_access()) {
                Ok(mr) => {
                    mrs[slot] = mr;
                    registered_in += t.elapsed();
                    self.counters.reg_calls.fetch_add(1, Ordering::Relaxed);
                    self.counters.reg_nanos.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    self.counters.reg_failures.fetch_add(1, Ordering::Relaxed);
                    chunk::deregister_and_unmap(&mrs, base, size);
                    return Err(HookError::Register(e, Registering::NewChunk));
                }
            }
        }
        if mrs.iter().any(|m| !m.is_null()) && self.inherited(meta) {
            if let Err(e) = chunk::keep_in_children(base, size) {
                chunk::deregister_and_unmap(&mrs, base, size);
                return Err(HookError::Advise(e));
            }
        }
        let Some(index) = chunk::publish(self.id, base, size, meta) else {
            chunk::deregister_and_unmap(&mrs, base, size);
            return Err(HookError::TableFull);
        };
        let rec = chunk::rec(index);
        self.note_commit_state(rec, size, uncommitted, kept);
        for (slot, &mr) in mrs.iter().enumerate() {
            if !mr.is_null() {
                rec.set_mr(slot, mr, self.registration_access());
                self.counters.registered[slot].fetch_add(size as u64, Ordering::Relaxed);
            }
        }
        self.count_new_chunk(size, meta);
        drop(bound);
        if self.trace_chunks {
            // Emitted by this thread once jemalloc returns (see events.rs).
            crate::heap::events::note(crate::heap::events::ChunkEvent {
                heap: self.id,
                bytes: size,
                node: self.numa_node(),
                metadata: meta,
                registrations: mrs.iter().filter(|m| !m.is_null()).count(),
                map: mapped_in,
                register: registered_in,
            });
        }
        Ok(base)
    }

    /// Counts a chunk just published.
    fn count_new_chunk(&self, size: usize, meta: bool) {
        self.counters.chunks.fetch_add(1, Ordering::Relaxed);
        self.counters.mapped.fetch_add(size as u64, Ordering::Relaxed);
        if meta {
            self.counters.meta.fetch_add(size as u64, Ordering::Relaxed);
        }
    }

    /// A chunk in a fork()ed child for an owner the parent made (the global allocator: the
    /// child keeps allocating): mapped and published, registered with nothing (the parent's PDs
    /// are not the child's) and without taking `bound` (a parent thread may have held it).
    fn new_chunk_unregistered(
        &self,
        size: usize,
        align: usize,
        meta: bool,
        uncommitted: bool,
    ) -> std::result::Result<usize, HookError> {
        let base = chunk::map(size, align).map_err(HookError::Map)?;
        // Bound to nothing here (see `new_chunk` on huge pages).
        if let Err(e) = chunk::advise(base, size, false, self.dontfork && !meta, meta) {
            chunk::unmap(base, size);
            return Err(HookError::Advise(e));
        }
        let Some(index) = chunk::publish(self.id, base, size, meta) else {
            chunk::deregister_and_unmap(&[], base, size);
            return Err(HookError::TableFull);
        };
        self.note_commit_state(chunk::rec(index), size, uncommitted, self.reserving.load(Ordering::Acquire) > 0);
        self.count_new_chunk(size, meta);
        Ok(base)
    }

    /// Whether a fork()ed child must find this chunk (jemalloc's metadata; every chunk of the
    /// global allocator): it is never kept out of children, and a registered one (data chunks
    /// only) is marked `MADV_DOFORK` again after each registration (`chunk::keep_in_children`).
    pub(super) fn inherited(&self, meta: bool) -> bool {
        meta || !self.dontfork
    }

    /// The access rights a chunk is registered with (data chunks only: see `registers_at_map`).
    pub(super) fn registration_access(&self) -> u32 {
        self.access.bits()
    }

    /// Takes `bound`. The thread is marked while it waits for and holds the lock
    /// ([`bound::holding_bound`]): in debug builds an allocation or free through the global
    /// allocator meanwhile is counted ([`bound::allocations_under_bound`]) — the alloc and purge hooks take this
    /// lock, so such a call can deadlock whenever it reaches a hook — and a heap's teardown
    /// waits for the liveness thread rather than run then.
    ///
    /// A `std` mutex (a futex), not `parking_lot`'s: the hooks take this lock inside jemalloc,
    /// and parking_lot allocates when a thread first parks or its table grows — through the
    /// global allocator, from inside an allocation. A poisoned lock is still taken: nothing
    /// under it leaves `Bound` half-updated (the PD array is written last, in one store).
    pub(crate) fn lock_bound(&self) -> BoundGuard<'_, Bound> {
        bound::lock(&self.bound)
    }

    /// The primary PD (slot 0), if bound.
    pub(crate) fn primary_pd(&self) -> Option<Pd> {
        self.lock_bound().pds[0].clone()
    }

    /// Every bound PD, in slot order.
    pub(crate) fn bound_pds(&self) -> Vec<Pd> {
        self.lock_bound().pds.iter().flatten().cloned().collect()
    }

    /// The slot `pd` is bound in.
    pub(crate) fn slot_of(&self, pd: &Pd) -> Option<usize> {
        self.lock_bound().pds.iter().position(|p| p.as_ref() == Some(pd))
    }

    /// Deregisters and unmaps every chunk (the arena must be gone, so the list is final; it is
    /// taken before locking: nothing allocates under `bound`).
    pub(crate) fn release_all(&self) {
        let chunks: Vec<(u32, usize, usize)> = chunk::owned_by(self.id)
            .map(|(i, r)| (i, r.base.load(Ordering::Relaxed), r.len.load(Ordering::Relaxed)))
            .collect();
        let bound = self.lock_bound();
        let mut kept = 0u64;
        for (index, base, len) in chunks {
            let rec = chunk::rec(index);
            let mut mrs = [std::ptr::null_mut(); MAX_PDS];
            for (slot, m) in rec.mrs.iter().enumerate() {
                mrs[slot] = m.swap(std::ptr::null_mut(), Ordering::AcqRel);
                if !mrs[slot].is_null() {
                    self.counters.registered[slot].fetch_sub(len as u64, Ordering::Relaxed);
                }
            }
            if rec.meta.load(Ordering::Relaxed) {
                self.counters.meta.fetch_sub(len as u64, Ordering::Relaxed);
            }
            if rec.idle.swap(false, Ordering::Relaxed) {
                self.counters.idle_chunks.fetch_sub(1, Ordering::Relaxed);
                self.counters.idle_bytes.fetch_sub(len as u64, Ordering::Relaxed);
            }
            let leaked = rec.leaked.swap(false, Ordering::Relaxed);
            chunk::release(index);
            if leaked {
                // A registration outside the record could not be removed: deregister the rest,
                // never unmap.
                mrs.iter().filter(|m| !m.is_null()).for_each(|&m| _ = chunk::deregister(m));
                crate::verbs::LEAKED_MAPPINGS.fetch_add(1, Ordering::Relaxed);
                kept += 1;
            } else {
                // Unmapped only if every registration let go; otherwise leaked, still pinned.
                if !chunk::deregister_and_unmap(&mrs, base, len) {
                    kept += 1;
                }
            }
            self.counters.chunks.fetch_sub(1, Ordering::Relaxed);
            self.counters.mapped.fetch_sub(len as u64, Ordering::Relaxed);
        }
        drop(bound);
        if kept > 0 {
            tracing::error!(kept, "ibv_dereg_mr refused: chunks left mapped (and pinned) rather than unmapped");
        }
    }
}
