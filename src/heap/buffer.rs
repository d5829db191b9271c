//! `Buffer`: bytes from a registered heap that know their keys.

use std::alloc::Layout;
use std::marker::PhantomData;
use std::ops::{Bound, Deref, DerefMut, RangeBounds};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::heap::keys::Keys;
use crate::heap::scoped::{free_raw, keys_for_in, keys_in};
use crate::heap::shared::Shared;
use crate::remote::RemoteBuf;
use crate::verbs::{Pd, Sge};

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
    layout: Layout,
    shared: NonNull<Shared>,
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
        Buffer { ptr, layout, shared }
    }

    #[inline]
    fn shared(&self) -> &Shared {
        // SAFETY: a live allocation keeps its heap's record alive.
        unsafe { self.shared.as_ref() }
    }

    /// Start address, as the NIC sees it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Keys for the heap's primary PD; `None` while the heap is bound to no PD.
    pub fn keys(&self) -> Option<Keys> {
        keys_in(self.shared(), self.ptr.as_ptr())
    }

    /// Keys for a specific bound PD.
    pub fn keys_for(&self, pd: &Pd) -> Option<Keys> {
        keys_for_in(self.shared(), self.ptr.as_ptr(), pd)
    }

    /// Local key (primary PD).
    pub fn lkey(&self) -> Option<u32> {
        self.keys().map(|k| k.lkey)
    }

    /// Remote key (primary PD) — only when the heap was built with a remote access right.
    pub fn rkey(&self) -> Option<u32> {
        if self.shared().owner.access.is_remote() {
            self.keys().map(|k| k.rkey)
        } else {
            None
        }
    }

    /// A scatter/gather entry for `range` of the buffer (primary PD).
    pub fn sge(&self, range: impl RangeBounds<usize>) -> Result<Sge> {
        let (s, e) = range_of(range, self.len())?;
        self.slice(s..e)?.sge()
    }

    /// What a peer needs to RDMA-access the whole buffer.
    pub fn remote(&self) -> Result<RemoteBuf> {
        self.as_slice().remote()
    }

    /// What a peer reaching this host through `pd`'s device needs (a heap bound to several PDs
    /// has one rkey per PD).
    pub fn remote_for(&self, pd: &Pd) -> Result<RemoteBuf> {
        if !self.shared().owner.access.is_remote() {
            return Err(Error::NoRemoteAccess);
        }
        let keys = self.keys_for(pd).ok_or(Error::NotRegistered { addr: self.addr() })?;
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

    fn as_slice(&self) -> BufSlice<'_> {
        BufSlice { ptr: self.ptr, len: self.layout.size(), shared: self.shared, _borrow: PhantomData }
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of layout.size() bytes, zero-filled when it was
        // allocated (Heap::alloc* use MALLOCX_ZERO) and only written through this Buffer or by
        // the NIC under an operation that borrows or owns it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: ptr/layout come from this heap's raw_alloc and are freed exactly once.
        unsafe { free_raw(self.shared, self.ptr, self.layout) };
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("keys", &self.keys())
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
        let keys = self.keys().ok_or(Error::NotRegistered { addr: self.addr() })?;
        Ok(Sge::new(self.addr(), len, keys.lkey))
    }

    /// What a peer needs to RDMA-access this range.
    pub fn remote(&self) -> Result<RemoteBuf> {
        // SAFETY: as in keys.
        if !unsafe { self.shared.as_ref() }.owner.access.is_remote() {
            return Err(Error::NoRemoteAccess);
        }
        let keys = self.keys().ok_or(Error::NotRegistered { addr: self.addr() })?;
        Ok(RemoteBuf { addr: self.addr(), len: self.len as u64, rkey: keys.rkey })
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
