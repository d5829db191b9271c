//! Heap statistics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::heap::chunk::MAX_PDS;
use crate::heap::owner::Owner;

/// Merges across chunk boundaries that the merge hook refused (process-wide).
pub(crate) static CROSS_CHUNK_MERGES_REFUSED: AtomicU64 = AtomicU64::new(0);

/// A snapshot of what a heap holds and what registering it cost.
///
/// More fields may come in later versions (`#[non_exhaustive]`): read the ones you need.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HeapStats {
    /// Chunks currently mapped.
    pub chunks: u64,
    /// Bytes currently mapped in chunks (once bound, all of it pinned but `metadata_bytes` and
    /// `idle_bytes`).
    pub mapped_bytes: u64,
    /// Of `mapped_bytes`, chunks that look like jemalloc's own metadata (base blocks: 2 MiB for
    /// each arena, more as its bookkeeping grows; `Global`'s arena 0 uses jemalloc's own). They are never registered — no buffer lies
    /// in them, and a registration would pin all of each block where jemalloc touches a few
    /// pages — nor kept out of `fork()` children (as data chunks are on kernels before 5.13),
    /// whose jemalloc touches them. So once bound, `registered_bytes + idle_bytes +
    /// metadata_bytes == mapped_bytes` for an eagerly registering heap.
    pub metadata_bytes: u64,
    /// Bytes registered per bound PD, in the order the PDs were bound.
    pub registered_bytes: [u64; MAX_PDS],
    /// Of `chunks`, those released as idle (see [`crate::heap::HeapBuilder::idle_release`]):
    /// registered nowhere and (unless the application locked their memory) resident nowhere,
    /// their address range kept for reuse.
    pub idle_chunks: u64,
    /// Of `mapped_bytes`, the bytes of the idle chunks.
    pub idle_bytes: u64,
    /// Chunks released as idle so far (each release of a chunk counts; its next use registers
    /// it again, counted in `reg_mr_calls` and `reg_mr_time`).
    pub idle_releases: u64,
    /// Bytes handed out and not yet freed, as requested by the callers.
    pub live_bytes: u64,
    /// Bytes of freed buffers kept in the threads' caches for reuse (see
    /// [`crate::heap::HeapBuilder::thread_cache`]): neither live nor returned to the heap.
    pub thread_cached_bytes: u64,
    /// Bytes of freed buffers a thread's cache gave up and the heap keeps for any thread's
    /// cache to take whole (at most one thread's budget, plus what threads that took a batch
    /// and could not keep it are handing back: see [`crate::heap::HeapBuilder::thread_cache`]):
    /// neither live nor returned to the heap.
    pub depot_bytes: u64,
    /// Bytes jemalloc counts as allocated in the heap's arena (includes objects parked in
    /// thread caches and the depot, and size-class rounding); `None` where jemalloc does not
    /// say.
    pub jemalloc_allocated: Option<u64>,
    /// `ibv_reg_mr` calls made for chunks (data chunks × PDs, plus registrations at bind time
    /// and idle chunks registered again; metadata is never registered); a buffer's own keys (`remote`, `expose`, `remote_desc`)
    /// are not counted.
    pub reg_mr_calls: u64,
    /// Of `reg_mr_calls`, chunks registered on their first use through a PD (see
    /// [`crate::heap::HeapBuilder::register_on_first_use`]).
    pub first_use_registrations: u64,
    /// Total time spent in `ibv_reg_mr`.
    pub reg_mr_time: Duration,
    /// Registrations that failed (each one failed an allocation or a bind).
    pub registration_failures: u64,
    /// Merges across chunk boundaries that were refused (process-wide counter).
    pub cross_chunk_merges_refused: u64,
}

impl HeapStats {
    pub(crate) fn from_owner(owner: &Owner, live_bytes: u64, jemalloc_allocated: Option<u64>) -> HeapStats {
        let c = &owner.counters;
        HeapStats {
            chunks: c.chunks.load(Ordering::Relaxed),
            mapped_bytes: c.mapped.load(Ordering::Relaxed),
            metadata_bytes: c.meta.load(Ordering::Relaxed),
            registered_bytes: std::array::from_fn(|i| c.registered[i].load(Ordering::Relaxed)),
            idle_chunks: c.idle_chunks.load(Ordering::Relaxed),
            idle_bytes: c.idle_bytes.load(Ordering::Relaxed),
            idle_releases: c.idle_releases.load(Ordering::Relaxed),
            live_bytes,
            thread_cached_bytes: 0,
            depot_bytes: 0,
            jemalloc_allocated,
            reg_mr_calls: c.reg_calls.load(Ordering::Relaxed),
            first_use_registrations: c.first_use_regs.load(Ordering::Relaxed),
            reg_mr_time: Duration::from_nanos(c.reg_nanos.load(Ordering::Relaxed)),
            registration_failures: c.reg_failures.load(Ordering::Relaxed),
            cross_chunk_merges_refused: CROSS_CHUNK_MERGES_REFUSED.load(Ordering::Relaxed),
        }
    }
}
