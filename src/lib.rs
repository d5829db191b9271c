//! # mralloc — registered memory for RDMA that feels like `std`
//!
//! RDMA NICs can only touch memory registered with them (`ibv_reg_mr`), and registering is slow
//! (tens of microseconds to milliseconds), pins pages, and hands back keys that must travel with
//! every work request. mralloc makes that disappear: its allocators take memory from jemalloc
//! arenas whose chunks are registered once, when jemalloc maps them, so every allocation is
//! already a memory region and any pointer the heap handed out maps to its keys in O(1).
//!
//! ## The whole path
//!
//! Heap → buffer → connect → write → verify. Here both ends are in one process (a loopback pair on
//! one device); between hosts, [`transfer::Listener`] / [`transfer::Connection::connect`] (TCP) or
//! [`transfer::CmListener`] / [`transfer::Connection::connect_cm`] (RDMA CM) set up the same thing.
//!
//! ```no_run
//! use mralloc::heap::Heap;
//! use mralloc::transfer::{Connection, Options, QpOptions};
//! use mralloc::verbs::{Access, Context, Pd};
//!
//! // 1. A registered heap on the device (MRALLOC_DEVICE, or the first active one).
//! let pd = Pd::new(&Context::open_default()?)?;
//! let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE).build()?;
//!
//! // 2. Buffers come out registered (no ibv_reg_mr per buffer, lkey included). One that a peer
//! //    may write is handed to the network: `expose` gives it a key of its own, covering
//! //    exactly its bytes, and no references to them while the peer may write.
//! let mut src = heap.alloc(4096)?;
//! let dst = heap.alloc(4096)?.expose()?;
//! src[..11].copy_from_slice(b"hello, rdma");
//!
//! // 3. Connect (two RC queue pairs; `dst.remote()` is what a peer would be sent). A connection
//! //    lets its peer WRITE, READ or use atomics on this side's memory only when asked to: the
//! //    target side (`_b` here; a pair's ends share the options) asks for REMOTE_WRITE.
//! let opts = Options {
//!     qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() },
//!     ..Options::default()
//! };
//! let (a, _b) = Connection::pair(&pd, &opts)?;
//!
//! // 4. Zero-copy RDMA WRITE; returns when the NIC is done with `src`.
//! a.write(&src[..11], &dst.remote(), 0)?;
//! let dst = dst.revoke()?; // the key is dead: the bytes are ours again
//! assert_eq!(&dst[..11], b"hello, rdma");
//! # Ok::<(), mralloc::Error>(())
//! ```
//!
//! Every step is safe code: buffers keep their heap's registration alive, remote ranges are
//! bounds-checked before anything is posted, and a failed connection refuses further posts with
//! the original error. The raw, `unsafe` verbs remain available in [`verbs`].
//!
//! ## Who owns memory the NIC uses
//!
//! Safe code cannot make the NIC touch memory that was freed or handed to a new owner:
//!
//! - Blocking operations ([`transfer::Connection::write`], `read`, `send`, `recv`, atomics,
//!   [`transfer::Batch::submit`]) borrow their memory and return only when the NIC is done with
//!   it — also when they fail (the connection is failed and its flush awaited first) or unwind.
//! - Non-blocking operations ([`transfer::Connection::post_write`] and friends) and remote grants
//!   ([`transfer::Connection::grant`]) *own* their buffer ([`transfer::IoBuf`],
//!   [`transfer::IoBufMut`]; a sub-range is an owned [`transfer::Slice`]). A borrow would not be
//!   enough: `mem::forget` ends a borrow without running any destructor. Dropping the handle
//!   parks the buffer with the connection until the completion arrives; forgetting it leaks the
//!   buffer; [`transfer::Pending::wait`] gives it back. A gather/scatter list is owned the same
//!   way — a `Vec<B>` or `[B; N]` of owned buffers, parked, leaked or given back whole — and a
//!   list of references is refused like one reference.
//!
//! ```compile_fail,E0277
//! # fn f(conn: &mralloc::transfer::Connection, heap: &mralloc::Heap) -> mralloc::Result<()> {
//! let mut buf = heap.alloc(4096)?;
//! let pending = conn.post_recv(&mut buf)?; // error: `&mut Buffer` is not an owned IoBufMut
//! std::mem::forget(pending);               // (this used to end the borrow early)
//! # Ok(()) }
//! ```
//!
//! ```no_run
//! # fn f(conn: &mralloc::transfer::Connection, heap: &mralloc::Heap) -> mralloc::Result<()> {
//! let pending = conn.post_recv(heap.alloc(4096)?)?; // the operation owns the buffer
//! let (buf, got) = pending.wait()?;                 // and gives it back when the NIC is done
//! println!("received {} bytes: {:?}", got.len, &buf[..got.len]);
//! # Ok(()) }
//! ```
//!
//! ## Global or scoped
//!
//! - [`heap::Heap`] is a scoped allocator: one arena, its own access rights, NUMA node, chunk cap
//!   and memory limit, behind a cheap clonable handle. [`heap::Buffer`]s have no lifetime: they
//!   move between threads and keep the heap's chunks registered while they live. Collections
//!   take a handle (`Vec::new_in(heap.clone())`) or borrow one: allocator-api2's `Vec` and
//!   `Box`, and hashbrown's `HashMap` (the heap implements the `Allocator` trait of
//!   allocator-api2 0.4 and of 0.2, which hashbrown uses). With feature `bytes`,
//!   [`heap::Buffer`]s become `bytes::Bytes` without a copy.
//! - `heap::Global` (feature `global`) is a `#[global_allocator]`: every `Vec`, `String` and
//!   `Box` of the process lives in hooked chunks, and `Global::bind` registers all of them —
//!   including memory allocated before `main` — so plain collections can be sent zero-copy
//!   ([`keys_of`]).
//!
//! ## Cargo features
//!
//! None is on by default.
//!
//! - `global`: `heap::Global`. It also defines jemalloc's start-up options symbol
//!   (`_rjem_malloc_conf`, with `oversize_threshold:0,disable_large_size_classes:false`), which
//!   Global needs; without this feature mralloc defines no such symbol, so a program may define
//!   its own (see [`heap::RECOMMENDED_MALLOC_CONF`]).
//! - `tokio`: `transfer::AsyncConnection` and friends, RDMA operations as futures; remote memory
//!   lent on request (`AsyncConnection::request_remote`); rail groups as futures (`AsyncRails`,
//!   with remote memory over every rail: `AsyncRails::request_remote`).
//! - `bytes`: [`heap::Buffer`] into `bytes::Bytes`.
//!
//! ## NUMA
//!
//! [`heap::NumaPolicy::DeviceLocal`] (the default) binds chunks to the NIC's node with `mbind`
//! before they are touched (registered pages cannot migrate later); `Node(n)` picks one; a device
//! without a node (virtual ones such as rxe) means no binding, and a `tracing` event says so.
//! [`heap::nodes_of_pages`] checks placement from outside.
//!
//! ## Remote grants and mapped files
//!
//! A peer reaches only what was exposed to it. [`heap::Buffer::expose`] registers exactly that
//! buffer with the heap's remote rights and hands out the registration's rkey: the device refuses
//! every access outside the buffer, and the key dies when the [`heap::Exposed`] is revoked or
//! dropped. While exposed, the buffer gives no references to its bytes (the peer may write them
//! at any moment), only volatile copies. [`heap::Buffer::remote`] is the read-only variant: a
//! key the peer can only read through, so the buffer stays usable. Chunks are registered for local access only; chunk-wide
//! rkeys (free to hand out, but reaching every allocation in the chunk, irrevocably) exist only
//! for heaps built with [`heap::HeapBuilder::remote_access_to_whole_chunks`], through
//! [`heap::Buffer::remote_whole_chunk`]. [`transfer::Connection::grant`] gives one connection a
//! revocable rkey of its own for exactly one owned buffer, revoked by
//! [`transfer::Grant::revoke`]: a type 2 memory window bound through that connection (no other
//! connection can use it), over the heap chunk where the device confines windows to their
//! range (probed once per device, [`verbs::Context::confines_memory_windows`]), else over a
//! registration of just the buffer without remote rights (Soft-RoCE on Linux 6.1 checks a window
//! only against the region under it). Lent remote memory (feature `tokio`) is keyed the same
//! way. And a connection's queue pair admits one-sided operations only with the rights its
//! [`transfer::QpOptions::remote_access`] asked for; the setup tells the peer, which refuses
//! the others before posting them ([`Error::NotGranted`]).
//! [`transfer::MappedFile`] maps and registers a file (read-only to send it, `create` to receive
//! one), so files move NIC to NIC without a copy.
//!
//! ## Memory the NIC writes, and who may look at it
//!
//! Rust's references promise that nothing changes the bytes behind a `&[u8]` (or touches those
//! behind a `&mut [u8]`) while it lives; a NIC writing them then would be undefined behaviour.
//! So every type the NIC can write either lends no references while it may be written, or
//! lends them only when no write can be pending:
//!
//! | type | written by | references meanwhile | why that is sound |
//! |---|---|---|---|
//! | [`heap::Buffer`], `[u8]`/`Vec<u8>` of heap memory, [`verbs::RegisteredBuf`], [`transfer::MappedFile`] | the local NIC: READ targets, receives, atomics results | none: the operation borrows it mutably (blocking calls, [`transfer::Batch`]) or owns it ([`transfer::Pending`], async operations) until the NIC is done | their keys give peers no write right: per-buffer keys ([`heap::Buffer::remote`], [`transfer::MappedFile::remote`]) are read-only, and `RegisteredBuf::new` refuses remote-write, atomic and window rights |
//! | [`heap::UninitBuffer`] | the local NIC (READ, receive) | none to uninitialised bytes; only [`heap::UninitBuffer::init_len`] bytes, which grow when an operation completes | the length it learns is [`transfer::Received::len`]: bounded by what was posted, 0 for a peer's WRITE with immediate |
//! | [`heap::Exposed`], [`verbs::RemoteWritable`] (an exposed `RegisteredBuf` or `MappedFile`) | a peer, at any moment, through its key | never: copies with atomic byte accesses only | `revoke` deregisters the key before references come back; dropping deregisters before freeing (and leaks if the device refuses) |
//! | [`transfer::Grant`], buffers lent through `transfer::RemoteMemory` or, over a rail group, `transfer::RailsRemoteMemory` (feature `tokio`) | a peer, through its one connection (over a rail group, through each rail's connection with that rail's key), with a key of exactly the buffer: a memory window bound through that connection, over the heap chunk where a one-time probe shows the device confines windows to their range ([`verbs::Context::confines_memory_windows`]), else over a registration of exactly its bytes without remote rights | never: the grant or the lending registry owns the buffer | the window is invalidated (or its QP flushed) and deallocated, and an exact registration deregistered, before the buffer comes back or is freed; a registration that cannot be removed leaks the buffer |
//! | [`transfer::SharedMessage`] | the local NIC, into its receive slot | `&[u8]` of the received bytes only after the receive completed | the slot is posted again only when the message is dropped |
//! | chunk-wide keys ([`heap::Buffer::remote_whole_chunk`]) | a peer, anywhere in the chunk | yes: the heap's ordinary buffers | only heaps built with the `unsafe` [`heap::HeapBuilder::remote_access_to_whole_chunks`] hand them out: the caller takes that on |
//!
//! Whatever a completion reports (lengths, opcodes, immediates) is interpreted in one place,
//! against what was posted into that buffer ([`transfer::Received`]).
//!
//! ## What is pinned, what is never purged
//!
//! Registered chunks are pinned and count against `RLIMIT_MEMLOCK`. mralloc's extent hooks never
//! purge, decommit or unmap registered memory (after `MADV_DONTNEED` the CPU and the NIC see
//! different pages, silently) and refuse merges across chunks. A chunk left wholly free for the
//! heap's idle interval ([`heap::HeapBuilder::idle_release`]) is deregistered first, then its
//! pages go back to the OS; chunks are unmapped when their heap is dropped. Registration failures come back as [`Error::Registration`] with the
//! current memlock limit; nothing aborts inside an allocator hook.
//!
//! ## `fork()`
//!
//! A child's copies of the parent's devices, heaps and connections stay the parent's: using one
//! fails with [`Error::Forked`], and dropping one releases nothing (the kernel objects are shared
//! with the parent, which keeps using them). The values a child holds in scoped heaps and
//! registered buffers (a `Vec<NonZeroU64, Heap>`, a `Box`, a map's `String`s) read as the
//! parent's at the fork: the kernel copies pinned pages into the child (Linux 5.13+; rdma-core's
//! `IBV_FORK_UNNEEDED`), so mralloc gives that memory no fork advice, and the parent's pinned
//! pages stay the NIC's. On older kernels that memory is kept out of children
//! (`MADV_DONTFORK`) and the child finds an inaccessible reservation there: touching it faults,
//! it never reads zeros posing as values. The same holds where rdma-core's fork support is
//! enabled (`ibv_fork_init`, `RDMAV_FORK_SAFE`), on any kernel, which mralloc never does itself
//! (it tries rdma-core out once, on a scratch page; support that is off then cannot be turned on
//! later, as after any registration: `ibv_fork_init` fails); the global allocator's chunks are
//! then marked `MADV_DOFORK` again after rdma-core marked them (jemalloc's metadata is never
//! registered), so that the child's allocator works (a bound global allocator's pages are then shared copy-on-write:
//! see `Global::bind`). mralloc's process-wide locks are free in the child whichever parent
//! thread held them, and the global allocator keeps allocating there (new chunks
//! unregistered). The child may open a device and build heaps and connections of its own.
//!
//! ## Getting an RDMA device
//!
//! Without an RDMA NIC, run programs under `scripts/softroce -- CMD`: it boots a small VM whose
//! kernel provides Soft-RoCE (`rdma_rxe`), a real kernel RDMA device, and sets `MRALLOC_DEVICE`
//! and `MRALLOC_GID_INDEX` for [`verbs::Context::open_default`].
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod clock;
mod error;
mod fork;
pub mod heap;
mod mmap;
mod os;
mod peer_bytes;
mod remote;
mod remote_desc;
pub mod transfer;
pub mod verbs;

pub use error::{AuthFailure, DescFault, Disconnect, Error, RemoteRefusal, Result};
pub use heap::{keys_of, keys_of_for, Buffer, Heap, Keys};
pub use remote::RemoteBuf;
pub use remote_desc::{DeviceKey, RemoteDesc};

/// Whether a `fork()`ed child of this process gets copies of the parent's registered memory
/// (scoped heaps' data, registered buffers), as decided for the process (on the first call, if
/// nothing decided it yet): `true` where the kernel copies pinned pages into children and
/// rdma-core leaves registrations without fork advice; `false` where that memory is kept out of
/// children (a child touching it faults). For tests, which expect one or the other.
#[doc(hidden)]
pub fn fork_children_get_copies() -> bool {
    fork::children_copy_pinned_pages()
}
