//! `UninitBuffer`: heap memory that is not initialised yet, for the NIC (or the CPU) to fill.

use std::alloc::Layout;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::heap::buffer::Buffer;
use crate::heap::keys::Keys;
use crate::heap::shared::Shared;

/// Memory from a [`crate::heap::Heap`] that is not initialised: what an RDMA READ or a receive
/// fills, without the zero-fill [`crate::heap::Heap::alloc`] pays (a 1 MiB buffer costs
/// microseconds to zero, more than the allocation).
///
/// Nothing can read its bytes before something wrote them: it does not deref to `&[u8]` and it
/// is not an [`crate::transfer::IoBuf`] (it cannot be the source of a WRITE or SEND, which would
/// show a peer whatever the memory held before). It tracks how many bytes, from the start, are
/// initialised ([`UninitBuffer::init_len`]):
/// - as the target of [`crate::transfer::Connection::post_read`] / `post_recv` (and the async
///   `read` / `recv`), the completion marks what arrived: the whole buffer for a READ, the
///   received length for a receive;
/// - the CPU writes with [`UninitBuffer::extend_from_slice`] or [`UninitBuffer::fill_rest`], or
///   through [`UninitBuffer::spare_mut`] and [`UninitBuffer::set_init`].
///
/// [`UninitBuffer::into_init`] then gives a [`Buffer`] of exactly the initialised bytes (same
/// memory and keys, no copy); [`UninitBuffer::into_buffer`] zero-fills what was not written and
/// gives the whole buffer.
///
/// ```no_run
/// # fn f(conn: &mralloc::transfer::Connection, heap: &mralloc::heap::Heap) -> mralloc::Result<()> {
/// let target = heap.alloc_uninit(1 << 20)?; // no zero-fill
/// let (target, got) = conn.post_recv(target)?.wait()?;
/// let msg = target.into_init(); // a Buffer of the got.len bytes that arrived
/// assert_eq!(msg.len(), got.len);
/// # Ok(()) }
/// ```
pub struct UninitBuffer {
    /// The allocation; its bytes past `init` are not initialised, so it is never dereferenced
    /// here beyond `init`.
    buf: Buffer,
    init: usize,
}

impl UninitBuffer {
    /// # Safety
    /// As [`Buffer::from_raw`]; the bytes need not be initialised.
    pub(crate) unsafe fn from_raw(ptr: NonNull<u8>, layout: Layout, shared: NonNull<Shared>) -> UninitBuffer {
        // SAFETY: forwarded; the Buffer is never dereferenced past `init` (see the field).
        UninitBuffer { buf: unsafe { Buffer::from_raw(ptr, layout, shared) }, init: 0 }
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.buf.size()
    }

    /// Whether the capacity is zero (never: heaps refuse empty allocations).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many bytes, from the start, are initialised.
    pub fn init_len(&self) -> usize {
        self.init
    }

    /// Start address, as the NIC sees it.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }

    /// Keys for the heap's primary PD; `None` while the heap is bound to no PD.
    pub fn keys(&self) -> Option<Keys> {
        self.buf.keys()
    }

    /// Local key (primary PD).
    pub fn lkey(&self) -> Option<u32> {
        self.buf.lkey()
    }

    /// Start pointer, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.buf.raw().as_ptr()
    }

    /// The initialised bytes.
    pub fn init_mut(&mut self) -> &mut [u8] {
        // SAFETY: [0, init) is initialised (the invariant of `init`) and lies in the allocation.
        unsafe { std::slice::from_raw_parts_mut(self.buf.raw().as_ptr(), self.init) }
    }

    /// The bytes past [`UninitBuffer::init_len`], to write into (then [`UninitBuffer::set_init`]).
    pub fn spare_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        let len = self.len() - self.init;
        // SAFETY: [init, len) lies in the allocation, which this value owns; MaybeUninit<u8>
        // may hold anything.
        unsafe { std::slice::from_raw_parts_mut(self.buf.raw().as_ptr().add(self.init).cast(), len) }
    }

    /// Marks the first `n` bytes as initialised (never lowers the mark).
    ///
    /// # Safety
    /// Bytes `[0, n)` were written (through [`UninitBuffer::spare_mut`], the pointer, or by the
    /// NIC), and `n <= len()`.
    ///
    /// # Panics
    /// If `n > len()` (checked in every build: a length past the allocation would let safe code
    /// read and write beyond it).
    pub unsafe fn set_init(&mut self, n: usize) {
        assert!(n <= self.len(), "set_init({n}) past the {}-byte buffer", self.len());
        self.init = self.init.max(n);
    }

    /// Appends `data` at [`UninitBuffer::init_len`].
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] (nothing written) if it does not fit.
    pub fn extend_from_slice(&mut self, data: &[u8]) -> Result<()> {
        let spare = self.spare_mut();
        if data.len() > spare.len() {
            return Err(Error::OutOfBounds {
                offset: self.init as u64,
                len: data.len() as u64,
                size: self.len() as u64,
            });
        }
        // SAFETY: data fits in the spare bytes, which do not overlap `data` (this value owns them).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), spare.as_mut_ptr().cast::<u8>(), data.len()) };
        self.init += data.len();
        Ok(())
    }

    /// Sets every byte past [`UninitBuffer::init_len`] to `byte`.
    pub fn fill_rest(&mut self, byte: u8) {
        let spare = self.spare_mut();
        // SAFETY: the spare bytes lie in the allocation; writing makes them initialised.
        unsafe { spare.as_mut_ptr().cast::<u8>().write_bytes(byte, spare.len()) };
        self.init = self.len();
    }

    /// A [`Buffer`] of the initialised bytes (`init_len()` long; the same memory and keys). The
    /// rest of the allocation stays with it and is freed with it.
    pub fn into_init(self) -> Buffer {
        let UninitBuffer { mut buf, init } = self;
        // SAFETY: [0, init) is initialised.
        unsafe { buf.set_len(init) };
        buf
    }

    /// The whole buffer, with the bytes nothing wrote set to zero.
    pub fn into_buffer(mut self) -> Buffer {
        self.fill_rest(0);
        self.buf
    }
}

impl std::fmt::Debug for UninitBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UninitBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("init", &self.init)
            .field("keys", &self.keys())
            .finish()
    }
}

/// The transfer layer's view: where the NIC may write, and how to record what it wrote.
impl UninitBuffer {
    pub(crate) fn target_parts(&mut self) -> (*mut u8, usize) {
        (self.buf.raw().as_ptr(), self.len())
    }
}
