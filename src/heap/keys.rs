//! Pointer → keys, for any byte any heap handed out.

use crate::heap::chunk::{self, ChunkRec};
use crate::heap::lazy;
use crate::verbs::{Access, Pd};

/// The memory-region keys covering a byte of heap memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Keys {
    /// Local key (for scatter/gather entries on this side).
    pub lkey: u32,
    /// The chunk registration's remote key. It reaches the **whole chunk**, and only with the
    /// rights the chunk was registered with: none for a scoped heap (unless built with
    /// [`crate::heap::HeapBuilder::remote_access_to_whole_chunks`]) or a plain
    /// `heap::Global`. To give a peer one buffer, use [`crate::heap::Buffer::expose`]
    /// or [`crate::heap::Buffer::remote`].
    pub rkey: u32,
    /// Start of the registered chunk holding the byte.
    pub chunk_base: usize,
    /// Length of that chunk.
    pub chunk_len: usize,
}

#[inline]
pub(crate) fn keys_in_slot(rec: &ChunkRec, slot: usize) -> Option<Keys> {
    use std::sync::atomic::Ordering::Relaxed;
    let (lkey, rkey) = rec.keys(slot)?;
    Some(Keys { lkey, rkey, chunk_base: rec.base.load(Relaxed), chunk_len: rec.len.load(Relaxed) })
}

/// The keys (for the owning heap's primary PD) of the registered chunk holding `ptr`, from any
/// heap — scoped or global. `None` for memory no heap handed out, or a heap bound to no PD.
/// O(1), lock-free: two table loads and a record read.
///
/// ```no_run
/// # let heap = mralloc::heap::Heap::new(&mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?)?;
/// let buf = heap.alloc(100)?;
/// assert_eq!(mralloc::keys_of(buf.as_ptr()).map(|k| k.lkey), buf.lkey());
/// assert!(mralloc::keys_of(&0u64 as *const u64).is_none()); // stack memory
/// # Ok::<(), mralloc::Error>(())
/// ```
#[inline]
pub fn keys_of<T>(ptr: *const T) -> Option<Keys> {
    let (rec, chunk_base, chunk_len) = chunk::find_span(ptr as usize)?;
    let (lkey, rkey) = rec.keys(0)?;
    Some(Keys { lkey, rkey, chunk_base, chunk_len })
}

/// Like [`keys_of`], for a specific PD the owning heap is bound to. A heap that registers on
/// first use ([`crate::heap::HeapBuilder::register_on_first_use`]) registers the chunk with
/// `pd` now if it had not yet (`None` if that fails; an operation using the memory through
/// `pd` reports why).
pub fn keys_of_for<T>(ptr: *const T, pd: &Pd) -> Option<Keys> {
    let (rec, slot) = lazy::registration_for(ptr.cast(), 1, pd).ok()?;
    keys_in_slot(rec, slot)
}

/// The lkey of `[ptr, ptr+len)` if it lies inside one registered chunk of a heap bound to `pd`
/// (a range spanning beyond its chunk is not one memory region: `None`).
#[inline]
pub(crate) fn lkey_within_chunk(ptr: *const u8, len: usize, pd: &Pd) -> Option<u32> {
    chunk::find_range(ptr as usize, len.max(1))?.lkey_in(pd.as_raw())
}

/// The chunk (`base`, `len`) of any heap holding `ptr` (registered unless idle, or not yet used
/// through a first-use PD); `None` for foreign memory.
pub fn chunk_of<T>(ptr: *const T) -> Option<(usize, usize)> {
    use std::sync::atomic::Ordering::Relaxed;
    let (_, rec) = chunk::find(ptr as usize)?;
    Some((rec.base.load(Relaxed), rec.len.load(Relaxed)))
}

/// The chunk's memory region in `pd` holding `ptr` (for binding memory windows) and the rights
/// it was registered with; registered now if its heap registers with `pd` on first use.
///
/// # Errors
/// [`crate::Error::NotRegistered`] if `ptr` is not memory of a heap bound to `pd`; what a
/// registration on first use fails with ([`crate::Error::Registration`], ...).
pub(crate) fn mr_and_access_of(ptr: *const u8, pd: &Pd) -> crate::Result<(*mut rdma_sys::ibv_mr, Access)> {
    let (rec, slot) = lazy::registration_for(ptr, 1, pd)?;
    let mr = rec.mr_in(slot, pd.as_raw()).ok_or(crate::Error::NotRegistered { addr: ptr as u64 })?;
    // Written before the registration was published (read with acquire by `mr_in`).
    let access = Access::from_bits_truncate(rec.access.load(std::sync::atomic::Ordering::Relaxed));
    Ok((mr, access))
}
