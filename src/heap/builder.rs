//! `HeapBuilder`: a [`Heap`]'s settings, and the heap's creation from them (arena, bindings,
//! jemalloc's per-arena settings).

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::heap::front::DEFAULT_THREAD_CACHE;
use crate::heap::hook_error::{take_hook_error, HookError};
use crate::heap::jemalloc;
use crate::heap::numa::{self, NumaPolicy};
use crate::heap::owner::Owner;
use crate::heap::pagemap::SLOT;
use crate::heap::scoped::Heap;
use crate::heap::shared::Shared;
#[cfg(doc)]
use crate::heap::{Buffer, HeapStats};
use crate::verbs::{Access, Pd};

/// Default cap on chunk size (`arena.N.retain_grow_limit`).
pub const DEFAULT_MAX_CHUNK: usize = 64 << 20;

/// Configures a [`Heap`].
#[derive(Debug, Clone)]
pub struct HeapBuilder {
    pds: Vec<Pd>,
    access: Access,
    numa: NumaPolicy,
    hugepages: bool,
    max_chunk: usize,
    limit: Option<usize>,
    whole_chunks: bool,
    thread_cache: usize,
    idle_release: Option<Duration>,
    first_use: bool,
}

impl HeapBuilder {
    /// Registers the heap with `pd` (call again for more PDs: multi-device registration, up to
    /// [`crate::heap::MAX_PDS`]). The first PD is the primary one: its keys are what
    /// [`Buffer::lkey`] and [`crate::keys_of`] report.
    pub fn bind(mut self, pd: &Pd) -> Self {
        self.pds.push(pd.clone());
        self
    }

    /// Register chunks with the PDs after the first one on first use (default off): a chunk
    /// is registered with the primary PD (the first one bound) when jemalloc maps it, as
    /// always, and with each other bound PD only the first time memory of it is used through
    /// that PD — as the local side of an operation on a connection of that PD, a grant, or
    /// keys asked for that PD ([`crate::keys_of_for`], [`Buffer::keys_for`],
    /// [`Heap::keys_for`]). For a heap bound to many NICs' PDs whose buffers each meet only
    /// some of them: one `ibv_reg_mr` per chunk up front instead of one per PD.
    ///
    /// The primary PD stays eager: [`Buffer::lkey`], [`Buffer::sge`], [`crate::keys_of`]
    /// and chunk-wide rkeys are its keys, looked up without a PD to register with, and an
    /// allocation must hand out memory that has them.
    ///
    /// The first use pays the registration of the whole chunk (milliseconds for a large one,
    /// see BENCHMARKS.md), on the using thread, holding the heap's registration lock (the
    /// heap's allocations that need a new chunk wait meanwhile); of threads racing the first
    /// use, one registers and the others use its registration. A failure fails that operation
    /// with [`Error::Registration`] and leaves the chunk as it was (the next use tries again).
    /// The registrations are released like the others: an idle chunk is deregistered from
    /// every PD (and registered again on its next use through each), the heap's drop
    /// deregisters all. [`HeapStats::registered_bytes`] shows each PD's share, and
    /// [`HeapStats::first_use_registrations`] counts them. Chunks [`Heap::reserve`] makes
    /// are registered with every PD at once. A trait method `lkey_for` of
    /// [`crate::transfer::Local`] or [`crate::transfer::IoBuf`] only looks keys up: it
    /// returns `None` for a chunk not yet used through `pd` (operations register it).
    pub fn register_on_first_use(mut self, on: bool) -> Self {
        self.first_use = on;
        self
    }

    /// Access rights. Default [`Access::LOCAL_WRITE`]: local use only.
    ///
    /// The remote rights (`REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`) are what
    /// [`Buffer::expose`] gives a buffer's own key ([`Buffer::remote`]: `REMOTE_READ` only) —
    /// a registration of that buffer alone, so a peer reaches nothing else. Chunks themselves
    /// are registered with the local rights only ([`Access::LOCAL_WRITE`], added whenever any
    /// remote right or [`Access::MW_BIND`] is asked for, and `MW_BIND`, which
    /// [`crate::transfer::Connection::grant`] needs), unless
    /// [`HeapBuilder::remote_access_to_whole_chunks`] says otherwise.
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Registers every chunk with the remote rights too, so that
    /// [`Buffer::remote_whole_chunk`] can hand out rkeys without a registration per buffer.
    ///
    /// **What this exposes:** such an rkey is the chunk's. A peer holding it can read and write
    /// (as the rights allow) every byte of the 2 MiB to [`HeapBuilder::max_chunk`] chunk the
    /// buffer lies in — every other buffer and collection allocated there, now and later, and
    /// whatever reuses a freed buffer's bytes — for as long as the heap lives; it cannot be
    /// revoked. Use it when every peer is trusted with the whole heap and the cost of a
    /// registration per exposed buffer matters (see BENCHMARKS.md, "Exposure").
    ///
    /// # Safety
    /// With write or atomic rights, a peer holding a chunk key can change any allocation of
    /// the heap — collections' elements, pointers, vtable-carrying objects, bytes Rust code
    /// holds references to — which is undefined behaviour for the local program unless the peer
    /// only touches memory the program treats as shared with the network (through
    /// [`crate::heap::Exposed`]-style volatile access, never references). The caller
    /// guarantees that of every peer it hands a chunk key to. With read-only rights the peer
    /// can read the whole chunk, which is a leak but not undefined behaviour.
    pub unsafe fn remote_access_to_whole_chunks(mut self) -> Self {
        self.whole_chunks = true;
        self
    }

    /// NUMA placement (default [`NumaPolicy::DeviceLocal`]).
    pub fn numa(mut self, policy: NumaPolicy) -> Self {
        self.numa = policy;
        self
    }

    /// Advise transparent huge pages for the data chunks of the heap while it is bound to a device
    /// (default on; no effect where THP is off): fewer pages to pin per registration. An unbound
    /// heap's data chunks get no advice (THP's `defrag=madvise` may compact memory at every
    /// advised fault); binding advises the chunks it finds. jemalloc's own metadata blocks always
    /// refuse huge pages (`MADV_NOHUGEPAGE`), whatever this says: it touches a few pages of each.
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

    /// Bytes of freed buffers each thread keeps for reuse, per heap (default
    /// [`DEFAULT_THREAD_CACHE`], 4 MiB; 0 turns the cache off). A thread that frees a buffer
    /// keeps it in a per-size-class cache, and its next allocation of that size class takes it
    /// back without reaching jemalloc: the fast path for code that allocates and frees
    /// buffers of the same sizes. Sizes up to 1 MiB are cached when their alignment is no
    /// more than jemalloc gives them unasked (8 below 16 bytes, 16 from 16 bytes on). The
    /// memory stays registered and counts in [`HeapStats::thread_cached_bytes`]; it returns to
    /// the heap when the thread exits or calls [`Heap::flush_thread_cache`], or the heap is
    /// dropped.
    ///
    /// A thread never keeps more than `bytes` for the heap. Each size class keeps at most
    /// 1 MiB worth of objects (and at most 2048), and takes its room from this budget as it
    /// fills; room a class reserved and no longer uses moves to a class that needs it. The
    /// cache's bookkeeping (8 bytes per object a class has room for, from the global
    /// allocator) is paid from the same budget, so objects and bookkeeping together stay
    /// within `bytes`.
    ///
    /// A class whose cache is full and cannot grow (at its most, or with the budget used up,
    /// if its older half holds at least 8 buffers or 64 KiB) hands its older half to the heap's
    /// depot and keeps the freed buffer; a free that finds no room otherwise goes to jemalloc.
    /// A thread whose cache of that class runs empty takes such a batch whole: a thread
    /// that only allocates and one that only frees (a receive loop handing buffers to a
    /// worker) both stay on their caches. The depot keeps at most `bytes` of objects too
    /// (counted in [`HeapStats::depot_bytes`]; its bookkeeping, 8 bytes an object and 32 a
    /// batch, comes on top), plus the batches threads took and handed back because their own
    /// budget could not pay for them, until they are taken again; a half that does not fit
    /// goes to jemalloc. What it keeps returns to the heap
    /// when an allocation finds the heap's limit reached, on [`Heap::flush_thread_cache`] (on
    /// any thread), and when the last thread with a cache of the heap exits; dropping the heap
    /// frees it with the rest.
    ///
    /// Behind this cache each thread has jemalloc's own thread cache for the heap (jemalloc
    /// 5.3's defaults: up to 200 objects of a small size class, fewer of the larger ones, and
    /// 20 of each size from 16 to 32 KiB; after many buffers of one size a thread holds about
    /// 8 KiB of 64 B ones, 48 KiB of 4 KiB ones, 640 KiB of 32 KiB ones): it is not part of
    /// `bytes` or of the statistics' cached bytes (it counts in
    /// [`HeapStats::jemalloc_allocated`]), stays with `thread_cache(0)`, and returns to the
    /// heap on [`Heap::flush_thread_cache`] and at thread exit.
    pub fn thread_cache(mut self, bytes: usize) -> Self {
        self.thread_cache = bytes;
        self
    }

    /// How long a chunk may stay unused before it is released (default
    /// [`crate::heap::DEFAULT_IDLE_RELEASE`], 10 s; `None`: never). A released chunk is
    /// deregistered from every PD and its pages go back to the OS (its address range stays
    /// reserved, and [`HeapStats::idle_chunks`] counts it); the next allocation jemalloc carves
    /// from it registers it again first — `ibv_reg_mr` of the whole chunk (milliseconds for a
    /// large one; the trade-off BENCHMARKS.md measures), on the allocating thread.
    ///
    /// A chunk is released only when all of it is free in jemalloc's view: no allocation, no
    /// object in a thread cache, no freed block jemalloc still keeps for reuse — it releases a
    /// freed block about `interval` after the free (its `dirty_decay_ms`), as a side effect of
    /// the heap's allocations and frees — no thread of its own: jemalloc's decay only runs inside
    /// a call, and takes a free in at the first run after it. So a heap that goes quiet after a
    /// burst keeps its chunks until it is called again: to give them back without more traffic,
    /// call [`Heap::decay`] once after the frees and once more after the interval
    /// ([`Heap::stats`] runs nothing). Objects in a thread's cache count as used: a thread that
    /// keeps running keeps up to its cache's bound (see [`HeapBuilder::thread_cache`]). Never released: chunks [`Heap::reserve`] made, chunks
    /// registered with remote rights ([`HeapBuilder::remote_access_to_whole_chunks`]: their
    /// rkeys may be with a peer), and chunks a registration of which the device refused to
    /// remove. An unbound heap's free blocks lose their pages after the interval too.
    pub fn idle_release(mut self, interval: Option<Duration>) -> Self {
        self.idle_release = interval;
        self
    }

    /// Creates the arena, binds the PDs and applies the settings.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (a `max_chunk` under 2 MiB, more than
    /// [`crate::heap::MAX_PDS`] PDs, jemalloc started with `opt.zero`), an invalid NUMA node, and what [`Heap::bind`] and the
    /// first chunk's creation fail with ([`Error::Registration`], [`Error::Io`],
    /// [`Error::DeviceRemoved`], ...).
    pub fn build(self) -> Result<Heap> {
        // Heaps dropped earlier whose buffers are all gone now (normally torn down already).
        crate::heap::shared::reap_draining();
        if self.max_chunk < SLOT {
            return Err(Error::InvalidArgument(format!("max_chunk must be at least {SLOT} bytes")));
        }
        if crate::heap::jemalloc::zeroes_everything() {
            return Err(Error::InvalidArgument(crate::heap::jemalloc::ZERO_REFUSED.into()));
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
        let chunk_access = if self.whole_chunks {
            self.access.union(Access::LOCAL_WRITE)
        } else if self.access.is_remote() || self.access.contains(Access::MW_BIND) {
            // Write grants and local NIC writes (receives, READ targets) need local write.
            self.access.without_remote().union(Access::LOCAL_WRITE)
        } else {
            self.access
        };
        let decay = crate::heap::idle::decay_ms(self.idle_release);
        let mut owner = Owner::new(chunk_access, node, self.hugepages, self.limit.unwrap_or(usize::MAX), decay);
        owner.first_use = self.first_use;
        let owner = Arc::new(owner);
        if self.first_use {
            crate::heap::lazy::enroll(&owner);
        }
        for pd in &self.pds {
            owner.bind_shared(pd)?;
        }
        // The hooks' reason read below must be this creation's (see `heap::hook_error`).
        take_hook_error();
        let arena = jemalloc::create_arena(owner.hooks_ptr());
        crate::heap::events::emit_pending();
        let arena = arena.map_err(|e| match take_hook_error() {
            HookError::None => e,
            hook => hook.into_error(SLOT),
        });
        let arena = match arena {
            Ok(a) => a,
            Err(e) => {
                owner.release_all();
                return Err(e);
            }
        };
        let id = owner.id;
        let born = owner.born;
        let heap = Heap {
            shared: Shared::create(owner, arena, self.max_chunk, self.access, self.whole_chunks, self.thread_cache),
            id,
            arena,
            born,
        };
        // The idle interval is jemalloc's dirty decay; no muzzy state (and so no eager purge of
        // large frees): decayed extents go straight to the decommit hook (see `heap::idle`).
        jemalloc::write::<isize>(&format!("arena.{arena}.dirty_decay_ms"), decay as isize)?;
        jemalloc::write::<isize>(&format!("arena.{arena}.muzzy_decay_ms"), -1)?;
        jemalloc::write::<usize>(&format!("arena.{arena}.retain_grow_limit"), self.max_chunk)?;
        Ok(heap)
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
            whole_chunks: false,
            thread_cache: DEFAULT_THREAD_CACHE,
            idle_release: Some(crate::heap::DEFAULT_IDLE_RELEASE),
            first_use: false,
        }
    }
}
