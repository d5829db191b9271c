//! `Buffer`: bytes from a registered heap that know their keys.

use std::alloc::Layout;
use std::marker::PhantomData;
use std::ops::{Bound, Deref, DerefMut, RangeBounds};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::heap::exposure::Slot;
use crate::heap::keys::Keys;
use crate::heap::paths::free_raw;
use crate::heap::scoped::{keys_for_in, keys_in};
use crate::heap::shared::Shared;
use crate::remote::RemoteBuf;
use crate::verbs::{Access, Pd, Sge};

/// Memory from a [`crate::heap::Heap`]: owns its bytes like a `Box<[u8]>`, and carries the keys
/// of the registered chunk it lies in. It has no lifetime: it keeps its heap's chunks
/// registered and mapped while it lives, so it can outlive every `Heap` handle, move to another
/// thread and be freed there.
///
/// ```no_run
/// # fn f(pd: &mralloc::verbs::Pd) -> mralloc::Result<()> {
/// let heap = mralloc::heap::Heap::new(pd)?;
/// let mut buf = heap.alloc(64)?;
/// drop(heap); // the buffer keeps the heap's chunks
/// buf.fill(1);
/// std::thread::spawn(move || drop(buf)).join().unwrap(); // freed on another thread
/// # Ok(()) }
/// ```
pub struct Buffer {
    ptr: NonNull<u8>,
    /// Bytes the buffer shows (at most `layout.size()`: an [`crate::heap::UninitBuffer`] turns
    /// into a buffer of the bytes that arrived).
    len: usize,
    /// The allocation, as it is freed.
    layout: Layout,
    shared: NonNull<Shared>,
    /// The buffer's own remote keys, once exposed ([`Buffer::remote`]).
    exposure: Slot,
}

// SAFETY: a Buffer owns its bytes exclusively (like Box<[u8]>); its heap record is thread-safe,
// and freeing from another thread uses that thread's cache.
unsafe impl Send for Buffer {}
// SAFETY: &Buffer only gives shared access to the bytes.
unsafe impl Sync for Buffer {}

/// Resolves `r` against a buffer of `len` bytes: `(start, end)`, or the typed out-of-bounds error.
pub(crate) fn range_of(r: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match r.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::OutOfBounds {
            offset: start as u64,
            len: end.saturating_sub(start) as u64,
            size: len as u64,
        });
    }
    Ok((start, end))
}

impl Buffer {
    /// # Safety
    /// `ptr` is a live allocation of `layout` from the heap behind `shared` that nothing else
    /// owns (the allocation itself keeps that heap alive).
    pub(crate) unsafe fn from_raw(ptr: NonNull<u8>, layout: Layout, shared: NonNull<Shared>) -> Buffer {
        Buffer { ptr, len: layout.size(), layout, shared, exposure: Slot::default() }
    }

    /// Shows only the first `len` bytes (the allocation stays whole and is freed whole).
    ///
    /// # Safety
    /// `len <= self.size()`, and those bytes are initialised.
    pub(crate) unsafe fn set_len(&mut self, len: usize) {
        // Checked in every build: a length past the allocation would let safe indexing reach
        // beyond it.
        assert!(len <= self.len, "set_len({len}) past the {}-byte buffer", self.len);
        self.len = len;
    }

    #[inline]
    fn shared(&self) -> &Shared {
        // SAFETY: a live allocation keeps its heap's record alive.
        unsafe { self.shared.as_ref() }
    }

    /// The start pointer, without going through `Deref` (no reference to the bytes is made:
    /// for memory a peer may be writing).
    pub(crate) fn raw(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The length, without going through `Deref`.
    pub(crate) fn size(&self) -> usize {
        self.len
    }

    /// Start address, as the NIC sees it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Keys for the heap's primary PD; `None` while the heap is bound to no PD.
    pub fn keys(&self) -> Option<Keys> {
        keys_in(self.shared(), self.ptr.as_ptr())
    }

    /// Keys for a specific bound PD (registered now if the heap registers with it on first
    /// use and had not: [`crate::heap::HeapBuilder::register_on_first_use`]; `None` if that
    /// fails).
    pub fn keys_for(&self, pd: &Pd) -> Option<Keys> {
        keys_for_in(self.shared(), self.ptr.as_ptr(), pd)
    }

    /// Local key (primary PD).
    pub fn lkey(&self) -> Option<u32> {
        self.keys().map(|k| k.lkey)
    }

    /// A scatter/gather entry for `range` of the buffer (primary PD).
    pub fn sge(&self, range: impl RangeBounds<usize>) -> Result<Sge> {
        let (s, e) = range_of(range, self.len())?;
        self.slice(s..e)?.sge()
    }

    /// A key with which a peer can RDMA-**read** this buffer — and only this buffer — through
    /// the heap's primary PD: address, length and an rkey of its own.
    ///
    /// The first call registers a memory region over exactly the buffer's bytes with
    /// [`Access::REMOTE_READ`] (later calls return the same key). The device checks every
    /// remote access against that range: one byte before or after the buffer fails at the peer
    /// with a remote access error, and so does every access after [`Buffer::revoke_remote`] or
    /// after the buffer is dropped (the registration is removed before the memory goes back to
    /// the heap). A peer reading while this side writes may see a mix of old and new bytes.
    ///
    /// For a key the peer may **write** (or use atomics on), use [`Buffer::expose`]: that
    /// takes the buffer, because no Rust reference to bytes the network may change at any
    /// moment can exist.
    ///
    /// Each registration is a system call, pins the buffer's pages once more against
    /// `RLIMIT_MEMLOCK` (the kernel counts every registration) and uses one of the device's
    /// memory regions (`max_mr`); BENCHMARKS.md ("Exposure") has the cost next to
    /// [`Buffer::remote_whole_chunk`], the free but chunk-wide alternative.
    ///
    /// # Errors
    /// [`Error::NoRemoteAccess`] if the heap was built without [`Access::REMOTE_READ`],
    /// [`Error::NotRegistered`] if the heap is bound to no PD, [`Error::Verbs`] if the device
    /// refuses the registration (`ibv_reg_mr`; the memlock limit is the usual cause),
    /// [`Error::Forked`] in a fork()ed child of the process that made the heap.
    pub fn remote(&self) -> Result<RemoteBuf> {
        let pd = self.primary_pd()?;
        self.remote_for(&pd)
    }

    /// [`Buffer::remote`] for a peer that reaches this host through `pd`'s device (any PD of
    /// this process; each PD gets a registration of its own).
    ///
    /// # Errors
    /// [`Error::NoRemoteAccess`] if the heap was built without [`Access::REMOTE_READ`],
    /// [`Error::Verbs`] if the device refuses the registration.
    pub fn remote_for(&self, pd: &Pd) -> Result<RemoteBuf> {
        self.check_readable()?;
        self.key_with(pd, Access::REMOTE_READ)
    }

    /// Refuses read-only keys in a fork()ed child and for a heap without remote read.
    pub(crate) fn check_readable(&self) -> Result<()> {
        self.shared().born.check("this heap")?;
        if !self.shared().access.contains(Access::REMOTE_READ) {
            return Err(Error::NoRemoteAccess);
        }
        Ok(())
    }

    /// Every PD the heap is bound to, in slot order.
    pub(crate) fn bound_pds(&self) -> Vec<Pd> {
        self.shared().owner.bound_pds()
    }

    pub(crate) fn primary_pd(&self) -> Result<Pd> {
        // Before the heap's lock (a fork()ed child: a parent thread may hold it).
        self.shared().born.check("this heap")?;
        if !self.shared().access.is_remote() {
            return Err(Error::NoRemoteAccess);
        }
        self.shared().owner.primary_pd().ok_or_else(|| Error::NotRegistered { addr: self.addr() })
    }

    /// The remote rights the heap was built with.
    pub(crate) fn heap_remote_rights(&self) -> Access {
        self.shared().access.remote_only()
    }

    /// A key over exactly this buffer, with `rights`, through `pd`.
    pub(crate) fn key_with(&self, pd: &Pd, rights: Access) -> Result<RemoteBuf> {
        // Before the exposure's lock (a fork()ed child: a parent thread may hold it).
        self.shared().born.check("this heap")?;
        // SAFETY: the buffer owns its bytes until Drop, and Drop (or leaking the buffer) never
        // frees them before `Slot::revoke` succeeded; the heap's chunks stay mapped while the
        // buffer lives. Callers give write/atomic rights only to an `Exposed`, which hands out
        // no reference to the bytes.
        let rkey = unsafe { self.exposure.rkey(pd, self.ptr.as_ptr(), self.size(), rights)? };
        Ok(RemoteBuf { addr: self.addr(), len: self.size() as u64, rkey })
    }

    /// Removes the keys [`Buffer::remote`] handed out: once this returns `Ok`, every remote
    /// access to the buffer fails at the peer with a remote access error. Calling
    /// [`Buffer::remote`] again exposes it with a new key.
    ///
    /// # Errors
    /// [`Error::Verbs`] (or [`Error::RevocationFailed`], for an earlier refusal) if the device
    /// refused to remove a registration: the buffer then stays reachable through it, and its
    /// memory is leaked (never reused) when the buffer is dropped. [`Error::Forked`] in a
    /// fork()ed child (the keys are the parent's).
    pub fn revoke_remote(&mut self) -> Result<()> {
        // Before the exposure's lock (a fork()ed child: a parent thread may hold it).
        self.shared().born.check("this heap")?;
        self.exposure.revoke()
    }

    /// Whether a peer may reach the buffer through a key of its own: [`Buffer::remote`] and no
    /// revocation since — or a revocation the device refused.
    pub fn is_exposed(&self) -> bool {
        self.exposure.is_exposed()
    }

    /// A remote descriptor that uses the **chunk's** rkey (primary PD): no registration per
    /// buffer, no cost — and no confinement.
    ///
    /// **What it exposes:** the key is that of the whole registered chunk the buffer lies in
    /// (2 MiB up to the heap's `max_chunk`). A peer holding it can reach every byte of that
    /// chunk with the heap's remote rights: the other buffers and collections there, now and
    /// later, and whatever reuses this buffer's bytes after it is freed, until the heap is
    /// gone. It cannot be revoked. Only for heaps built with
    /// [`crate::heap::HeapBuilder::remote_access_to_whole_chunks`], and only for peers trusted
    /// with all of the heap.
    ///
    /// # Errors
    /// [`Error::NoWholeChunkAccess`] if the heap was not built for chunk-wide keys,
    /// [`Error::NoRemoteAccess`] if it has no remote rights, [`Error::NotRegistered`] if it is
    /// bound to no PD.
    pub fn remote_whole_chunk(&self) -> Result<RemoteBuf> {
        let s = self.shared();
        if !s.access.is_remote() {
            return Err(Error::NoRemoteAccess);
        }
        if !s.whole_chunks {
            return Err(Error::NoWholeChunkAccess);
        }
        let keys = self.keys().ok_or_else(|| Error::NotRegistered { addr: self.addr() })?;
        Ok(RemoteBuf { addr: self.addr(), len: self.len() as u64, rkey: keys.rkey })
    }

    /// A borrowed view of `range` that keeps the keys.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<BufSlice<'_>> {
        let (s, e) = range_of(range, self.len())?;
        Ok(BufSlice {
            // SAFETY: s <= len, so the pointer stays inside (or one past) the allocation.
            ptr: unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(s)) },
            len: e - s,
            shared: self.shared,
            _borrow: PhantomData,
        })
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of at least len bytes, zero-filled when it was
        // allocated (Heap::alloc* use MALLOCX_ZERO) or initialised up to len before an
        // UninitBuffer became this Buffer, and only written through this Buffer or by the NIC
        // under an operation that borrows or owns it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // One load for both questions while the heap has handles (see `free_raw`).
        let common = self.shared().frees_common();
        if !common && !self.shared().born.here() {
            return; // a parent's buffer in a fork()ed child: nothing to release, nothing to say
        }
        if let Err(e) = self.exposure.revoke() {
            // A peer may still reach these bytes: they must never be reused. The heap stays
            // alive (this allocation is never freed), so its chunks stay mapped.
            tracing::error!("{e}: leaking an exposed buffer of {} bytes at {:#x}", self.size(), self.addr());
            crate::verbs::LEAKED_MAPPINGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        // SAFETY: ptr/layout come from this heap's raw_alloc and are freed exactly once, and no
        // registration of the buffer's own is left (revoked above).
        unsafe { free_raw(self.shared, self.ptr, self.layout, common) };
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for Buffer {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

#[cfg(feature = "bytes")]
#[cfg_attr(docsrs, doc(cfg(feature = "bytes")))]
impl Buffer {
    /// The buffer as a [`bytes::Bytes`], without a copy: clones and slices of it share the
    /// registered bytes (their keys stay reachable through [`crate::keys_of`]), and the buffer
    /// is freed, to its heap, when the last of them is dropped. A buffer with a read-only
    /// remote key ([`Buffer::remote`]) keeps it until then.
    ///
    /// ```no_run
    /// # fn f(heap: &mralloc::Heap) -> mralloc::Result<()> {
    /// let mut buf = heap.alloc(4096)?;
    /// buf[..5].copy_from_slice(b"hello");
    /// let bytes = buf.into_bytes();
    /// let head = bytes.slice(..5); // shares the registered memory
    /// assert!(mralloc::keys_of(head.as_ptr()).is_some());
    /// # Ok(()) }
    /// ```
    pub fn into_bytes(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }
}

#[cfg(feature = "bytes")]
impl From<Buffer> for bytes::Bytes {
    fn from(buf: Buffer) -> bytes::Bytes {
        buf.into_bytes()
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("keys", &self.keys())
            .field("exposed", &self.is_exposed())
            .finish()
    }
}

/// A borrowed range of a [`Buffer`] that keeps its keys.
#[derive(Clone, Copy)]
pub struct BufSlice<'a> {
    ptr: NonNull<u8>,
    len: usize,
    shared: NonNull<Shared>,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: a BufSlice is a shared borrow of bytes, like &[u8].
unsafe impl Send for BufSlice<'_> {}
// SAFETY: as above.
unsafe impl Sync for BufSlice<'_> {}

impl BufSlice<'_> {
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Keys (primary PD).
    pub fn keys(&self) -> Option<Keys> {
        // SAFETY: the slice borrows a live Buffer, which keeps the record alive.
        keys_in(unsafe { self.shared.as_ref() }, self.ptr.as_ptr())
    }

    /// Local key (primary PD).
    pub fn lkey(&self) -> Option<u32> {
        self.keys().map(|k| k.lkey)
    }

    /// A scatter/gather entry for the whole slice.
    pub fn sge(&self) -> Result<Sge> {
        let len = u32::try_from(self.len)
            .map_err(|_| Error::InvalidArgument(format!("an SGE holds at most 4 GiB, got {} bytes", self.len)))?;
        let keys = self.keys().ok_or_else(|| Error::NotRegistered { addr: self.addr() })?;
        Ok(Sge::new(self.addr(), len, keys.lkey))
    }
}

impl Deref for BufSlice<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the slice lies inside a live Buffer that this value borrows.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for BufSlice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufSlice").field("addr", &format_args!("{:#x}", self.addr())).field("len", &self.len).finish()
    }
}
