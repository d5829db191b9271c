//! Owned buffers for operations that outlive the call that started them.
//!
//! A non-blocking operation ([`crate::transfer::Pending`], [`crate::transfer::Grant`]) may
//! still be in the NIC's hands after its handle is dropped — or forgotten with `mem::forget`,
//! which ends any borrow without running a destructor. So such operations take their memory by
//! value, as an [`IoBuf`] (the NIC reads it) or [`IoBufMut`] (the NIC writes it): the operation
//! owns the memory, and whatever happens to the handle the memory is either given back after the
//! completion, released by the connection when the completion is reaped, or leaked — never
//! freed while the NIC may touch it. References and plain slices are not `IoBuf`s; a sub-range
//! is an owned [`Slice`] (the buffer plus a range; [`Slice::into_inner`] gives the buffer back).
//!
//! A non-blocking or async operation takes one such buffer, or a gather/scatter list of them —
//! a `Vec<B>` or `[B; N]` of one `IoBuf` type (a WRITE's or SEND's source) or `IoTarget` type
//! (a READ's or receive's target, filled in order) — as one request with several entries, and
//! owns (and gives back, or parks) the whole list. A list of references is refused like a
//! single reference.
//!
//! Blocking operations ([`crate::transfer::Connection::write`] and friends) keep accepting
//! borrowed memory ([`crate::transfer::Local`]): they do not return while the NIC may touch it.

use std::ops::{Deref, RangeBounds};
use std::sync::Arc;

use crate::error::Error;
use crate::heap::{lkey_within_chunk, range_of, Buffer, Heap, UninitBuffer};
use crate::transfer::MappedFile;
use crate::verbs::{Pd, RegisteredBuf};

/// Memory an operation can own while the NIC reads it.
///
/// # Safety
/// Implementors promise, for the whole life of the value *and forever if it is leaked*
/// (`mem::forget`, a reference cycle):
/// - `stable_ptr()..stable_ptr() + bytes_len()` is valid, initialised memory that only the
///   value's own `Drop` can free; moving the value does not move or change those bytes, and
///   neither `stable_ptr` nor `bytes_len` changes while no `&mut` method is called;
/// - nothing but the value itself can write those bytes (no shared ownership with a writer, no
///   interior mutability reachable through `&self`);
/// - `lkey_for(pd)` returns only a key of a memory region of `pd` covering the whole range.
pub unsafe trait IoBuf: Send + 'static {
    /// Start of the bytes (stable across moves).
    fn stable_ptr(&self) -> *const u8;

    /// Number of bytes an operation uses.
    fn bytes_len(&self) -> usize;

    /// The local key covering the whole range in `pd`, if registered there. The default looks
    /// the range up in the registered heaps' page map.
    ///
    /// # Errors
    /// Returns `None` if the range is not registered in `pd` as one region (by default: not
    /// inside one chunk of a heap bound to `pd`); operations then refuse the buffer with
    /// [`crate::Error::NotRegistered`].
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        lkey_within_chunk(self.stable_ptr(), self.bytes_len(), pd)
    }

    /// The owned sub-range `range` of this buffer.
    ///
    /// # Errors
    /// [`crate::Error::OutOfBounds`] (with the buffer back in [`Rejected`]) if the range is
    /// reversed or does not lie inside the buffer.
    fn into_slice(self, range: impl RangeBounds<usize>) -> Result<Slice<Self>, Rejected<Self>>
    where
        Self: Sized,
    {
        match range_of(range, self.bytes_len()) {
            Ok((start, end)) => Ok(Slice { buf: self, start, end }),
            Err(error) => Err(Rejected { error, buf: Some(self) }),
        }
    }
}

/// Memory an operation can own while the NIC writes it (RDMA READ targets, receives, grants
/// with remote write).
///
/// # Safety
/// As [`IoBuf`], and the range is writable memory that nothing else reads or writes while an
/// operation owns the value.
pub unsafe trait IoBufMut: IoBuf {
    /// Start of the bytes, for writing.
    fn stable_mut_ptr(&mut self) -> *mut u8;
}

/// An owned range of an [`IoBuf`]: what a non-blocking operation takes to use part of a buffer.
/// The range is checked once, when the slice is made; the buffer cannot be replaced or resized
/// through the slice (there is no `get_mut`), so it stays valid.
///
/// ```no_run
/// # fn f(conn: &mralloc::transfer::Connection, heap: &mralloc::Heap, remote: &mralloc::RemoteBuf) -> mralloc::Result<()> {
/// use mralloc::transfer::IoBuf;
/// let buf = heap.alloc(1 << 20)?;
/// let pending = conn.post_write(buf.into_slice(4096..8192)?, remote, 0)?;
/// let (slice, _) = pending.wait()?;
/// let buf = slice.into_inner(); // the whole buffer back
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Slice<B> {
    buf: B,
    start: usize,
    end: usize,
}

impl<B: IoBuf> Slice<B> {
    /// Offset of the range's start in the buffer.
    pub fn begin(&self) -> usize {
        self.start
    }

    /// Offset of the range's end in the buffer.
    pub fn end(&self) -> usize {
        self.end
    }

    /// The whole buffer.
    pub fn get_ref(&self) -> &B {
        &self.buf
    }

    /// Gives the buffer back.
    pub fn into_inner(self) -> B {
        self.buf
    }
}

impl<B: IoBuf> Deref for Slice<B> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: IoBuf: the range is valid, initialised memory of the buffer, which we own.
        unsafe { std::slice::from_raw_parts(self.stable_ptr(), self.bytes_len()) }
    }
}

// SAFETY: a range inside an IoBuf's stable range (checked when the Slice was made), owned
// with the buffer; the buffer's key covers its whole range, so it covers this part.
unsafe impl<B: IoBuf> IoBuf for Slice<B> {
    fn stable_ptr(&self) -> *const u8 {
        // SAFETY: start <= bytes_len of the buffer (range_of checked it).
        unsafe { self.buf.stable_ptr().add(self.start) }
    }
    fn bytes_len(&self) -> usize {
        self.end - self.start
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.buf.lkey_for(pd)
    }
}

// SAFETY: as above, and the buffer's range is writable and exclusively ours.
unsafe impl<B: IoBufMut> IoBufMut for Slice<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: as in stable_ptr.
        unsafe { self.buf.stable_mut_ptr().add(self.start) }
    }
}

// SAFETY: a Buffer owns its heap allocation (only its Drop frees it; a leaked Buffer keeps its
// heap's chunks registered forever); the allocation does not move with the handle; its keys
// come from the page map.
// Pointer and length never go through `Deref`: they are read while the NIC or a peer (a grant,
// lent memory) may be writing the bytes, when no reference to them may exist.
unsafe impl IoBuf for Buffer {
    fn stable_ptr(&self) -> *const u8 {
        self.raw().as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.size()
    }
}
// SAFETY: as above; the Buffer is the only owner of its bytes.
unsafe impl IoBufMut for Buffer {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.raw().as_ptr()
    }
}

// SAFETY: a Vec's heap buffer is owned by it, freed only by its Drop, and does not move with
// the Vec (no method that could reallocate is reachable while an operation owns it). Its key
// is looked up in the page map (plain Vecs have keys when `heap::Global` is the process
// allocator and bound).
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}
// SAFETY: as above.
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

// SAFETY: as Vec<u8>.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}
// SAFETY: as above.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

// SAFETY: as Vec<u8>; the allocation lives in the heap the Vec holds a handle of.
unsafe impl IoBuf for allocator_api2::vec::Vec<u8, Heap> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}
// SAFETY: as above.
unsafe impl IoBufMut for allocator_api2::vec::Vec<u8, Heap> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

// SAFETY: a `Bytes` keeps its storage alive and unmoved while it (or a clone) lives, and gives
// no way to write to it (sends and WRITE sources only read). Its key is looked up in the page
// map: a `Bytes` made from a heap `Buffer` (`Buffer::into_bytes`) or a slice of one has keys.
#[cfg(feature = "bytes")]
#[cfg_attr(docsrs, doc(cfg(feature = "bytes")))]
unsafe impl IoBuf for bytes::Bytes {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: a RegisteredBuf owns its mapping and its memory region, which covers all of it.
unsafe impl IoBuf for RegisteredBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.mr().lkey_in(pd)
    }
}
// SAFETY: as above; registered with whatever access it was given (the NIC checks LOCAL_WRITE).
unsafe impl IoBufMut for RegisteredBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

// SAFETY: a MappedFile owns its mapping and registration (unmapped only by its Drop); the region
// covers the whole file; nothing else writes the bytes (the unsafe contract of its constructors).
unsafe impl IoBuf for MappedFile {
    fn stable_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.mr().lkey_in(pd)
    }
}
// SAFETY: as above, and nothing else reads the bytes while the NIC writes them (the constructors'
// contract); a read-only file's region lacks LOCAL_WRITE, so the NIC refuses to write it (a
// completion error), and the CPU cannot reach it mutably while an operation owns it.
unsafe impl IoBufMut for MappedFile {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.mut_ptr()
    }
}

// SAFETY: an Arc keeps its value (and so the value's memory) alive while any clone lives, and a
// leaked clone keeps it forever; shared ownership gives only `&` access, so no clone can write
// the bytes (T: IoBuf promises no interior mutability of them). For the NIC to read only.
unsafe impl<T: IoBuf + Sync> IoBuf for Arc<T> {
    fn stable_ptr(&self) -> *const u8 {
        (**self).stable_ptr()
    }
    fn bytes_len(&self) -> usize {
        (**self).bytes_len()
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        (**self).lkey_for(pd)
    }
}

/// Memory an operation can own while the NIC fills it: the target of an RDMA READ or a receive
/// ([`crate::transfer::Connection::post_read`], `post_recv`, and the async `read` / `recv`),
/// initialised or not. Every [`IoBufMut`] is one, and so is [`UninitBuffer`], which has no
/// initialised bytes to show until the NIC wrote them: the operation tells it how many arrived.
///
/// # Safety
/// As [`IoBufMut`] for the range `target()` returns, except that the bytes need not be
/// initialised; `filled` only records what the caller guarantees. `target()` returns the same
/// range on every call (operations call it when posting and again when the NIC is done, to
/// tell each part of a list what landed in it).
pub unsafe trait IoTarget: Send + 'static {
    /// Start and length of the memory the NIC may write (stable across moves).
    fn target(&mut self) -> (*mut u8, usize);

    /// The local key covering the whole target in `pd`, if registered there.
    ///
    /// # Errors
    /// Returns `None` if the target is not registered in `pd` as one region; operations then
    /// refuse it with [`crate::Error::NotRegistered`].
    fn target_lkey(&self, pd: &Pd) -> Option<u32>;

    /// Records that the NIC wrote the first `n` bytes (a READ: all of them; a receive: what
    /// arrived). The default does nothing: initialised memory has nothing to learn.
    ///
    /// # Safety
    /// `[0, n)` of the target was written, and `n` is at most its length.
    unsafe fn filled(&mut self, n: usize) {
        let _ = n;
    }
}

// SAFETY: an IoBufMut's range is valid, stable, writable memory only the value can free.
unsafe impl<B: IoBufMut> IoTarget for B {
    fn target(&mut self) -> (*mut u8, usize) {
        (self.stable_mut_ptr(), self.bytes_len())
    }
    fn target_lkey(&self, pd: &Pd) -> Option<u32> {
        self.lkey_for(pd)
    }
}

// SAFETY: an UninitBuffer owns its allocation like a Buffer (stable, freed only by its Drop,
// which keeps the heap's chunks mapped until then) and shows no byte it did not learn was written.
unsafe impl IoTarget for UninitBuffer {
    fn target(&mut self) -> (*mut u8, usize) {
        self.target_parts()
    }
    fn target_lkey(&self, pd: &Pd) -> Option<u32> {
        lkey_within_chunk(self.addr() as *const u8, self.len(), pd)
    }
    unsafe fn filled(&mut self, n: usize) {
        // SAFETY: the caller's contract.
        unsafe { self.set_init(n) };
    }
}

/// A post that was refused before reaching the NIC, or an operation that failed: the error, and
/// the buffer back.
#[derive(Debug)]
pub struct Rejected<B> {
    /// Why.
    pub error: Error,
    /// The buffer back: untouched by the NIC if the post was refused, or finished with if the
    /// operation failed. `None` only if the NIC may still own it (a failed connection whose flush
    /// never arrived, [`Error::FlushLost`]): then it is leaked rather than freed.
    pub buf: Option<B>,
}

impl<B> std::fmt::Display for Rejected<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.error)
    }
}

impl<B: std::fmt::Debug> std::error::Error for Rejected<B> {}

impl<B> From<Rejected<B>> for Error {
    fn from(r: Rejected<B>) -> Error {
        r.error
    }
}
