//! The registered heap: jemalloc arenas whose chunks are RDMA memory regions.
//!
//! Custom jemalloc extent hooks map every arena chunk 2 MiB-aligned,
//! bind it to the NIC's NUMA node, register it with each bound PD (`ibv_reg_mr`; not jemalloc's
//! own metadata blocks, where no buffer lies) and record it in
//! a lock-free page map, so any pointer the heap handed out maps to its keys in O(1)
//! ([`crate::keys_of`]). Registered pages are never purged, decommitted or unmapped while
//! registered; a chunk wholly free for the heap's idle interval is deregistered, then its pages
//! are dropped (registered again when next used: see `idle.rs`); chunks are unmapped when their
//! heap is dropped.
//!
//! - `Global` (feature `global`): the process allocator (`#[global_allocator]`) over jemalloc's
//!   automatic arenas, so every `Vec` is RDMA-ready after `Global::bind`.
//! - [`Heap`]: a scoped heap (one arena, per-thread caches of freed buffers) behind a cheap, clonable
//!   handle, usable as an `allocator_api2` allocator (`Vec::new_in(heap.clone())` or `&heap`)
//!   and through [`Buffer`]s, which have no lifetime and keep the heap alive.

mod allocator;
mod binding;
mod bound;
mod buffer;
mod builder;
mod chunk;
mod classes;
mod conf;
mod depot;
mod desc;
#[cfg(test)]
mod device_tests;
mod events;
mod exposed;
mod exposure;
mod front;
#[cfg(feature = "global")]
mod global;
mod hook_error;
#[cfg(test)]
mod hook_error_tests;
mod hooks;
mod idle;
mod jemalloc;
mod keys;
mod lazy;
mod numa;
mod owner;
mod pagemap;
mod paths;
mod reserve;
mod scoped;
mod shared;
mod stats;
mod tcache;
mod uninit;

pub(crate) use buffer::range_of;
pub use buffer::{BufSlice, Buffer};
pub use builder::{HeapBuilder, DEFAULT_MAX_CHUNK};
pub use chunk::MAX_PDS;
pub use conf::{MallocConf, RECOMMENDED_MALLOC_CONF};
pub use exposed::{ExposeError, Exposed};
pub use front::DEFAULT_THREAD_CACHE;
#[cfg(feature = "global")]
#[cfg_attr(docsrs, doc(cfg(feature = "global")))]
pub use global::Global;
pub use idle::DEFAULT_IDLE_RELEASE;
pub use keys::{chunk_of, keys_of, keys_of_for, Keys};
pub(crate) use keys::{lkey_within_chunk, mr_and_access_of};
pub(crate) use lazy::lkey_or_register;
pub use numa::{nodes_of_pages, online_nodes, NumaPolicy};
pub use scoped::{draining_heaps, Heap};
pub use stats::HeapStats;
pub(crate) use tcache::forget_in_child as forget_fronts_in_child;
pub use uninit::UninitBuffer;
