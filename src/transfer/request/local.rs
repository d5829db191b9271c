//! What can be the local side of a *blocking* operation: heap buffers, slices of any heap
//! memory, registered buffers and mapped files — anything whose bytes lie in one memory region
//! of the connection's PD, borrowed for the call. Foreign memory is a typed error, found before
//! anything is posted. (Non-blocking operations take owned memory: [`crate::transfer::IoBuf`].)

use crate::error::{Error, Result};
use crate::heap::{lkey_or_register, lkey_within_chunk, BufSlice, Buffer};
use crate::transfer::request::iobuf::{IoBuf, IoBufMut, Slice};
use crate::verbs::{Exposable, Pd, RegisteredBuf, RemoteWritable, Sge};

/// Memory the NIC may read for a blocking operation (the source of WRITE and SEND), borrowed for
/// the call.
///
/// # Safety
/// `local_ptr()..local_ptr()+local_len()` must be valid, initialised memory for as long as the
/// implementing value is borrowed by an operation, and `lkey_for` must only return a key of a
/// memory region of `pd` that covers that whole range.
pub unsafe trait Local {
    /// Start of the bytes.
    fn local_ptr(&self) -> *const u8;
    /// Number of bytes.
    fn local_len(&self) -> usize;
    /// The local key covering the whole range in `pd`, if registered there.
    ///
    /// # Errors
    /// Returns `None` if the range is not registered in `pd` as one region (by default: not
    /// inside one chunk of a heap bound to `pd`); operations then fail with
    /// [`Error::NotRegistered`].
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        lkey_within_chunk(self.local_ptr(), self.local_len(), pd)
    }
}

/// Memory the NIC may write for an operation (the target of READ, receives, atomics results).
///
/// # Safety
/// As [`Local`], and the range must be writable and not aliased while an operation holds it.
pub unsafe trait LocalMut: Local {}

/// A bounds-checked SGE for `local` in `pd`, or the typed error saying why not.
pub(crate) fn sge_of<L: Local + ?Sized>(local: &L, pd: &Pd) -> Result<Sge> {
    sge_of_parts(local.local_ptr(), local.local_len(), local.lkey_for(pd), pd)
}

/// An SGE for `len` bytes at `ptr` under `lkey`, or the typed error saying why not (an empty
/// range gets an empty entry, refused by `Connection::request`). Without a key, heap memory
/// not yet used through `pd` is registered with it now, if its heap registers on first use.
pub(crate) fn sge_of_parts(ptr: *const u8, len: usize, lkey: Option<u32>, pd: &Pd) -> Result<Sge> {
    let len32 = u32::try_from(len)
        .map_err(|_| Error::InvalidArgument(format!("one operation moves at most 4 GiB - 1, got {len} bytes")))?;
    let addr = ptr as u64;
    if len == 0 {
        // Refused by the request's check, which names the operation (no key to look up).
        return Ok(Sge::new(addr, 0, 0));
    }
    // Not `ok_or_else` on the hot path: a key found is used as is.
    let lkey = match lkey {
        Some(lkey) => lkey,
        None => lkey_or_register(ptr, len, pd)?,
    };
    Ok(Sge::new(addr, len32, lkey))
}

// SAFETY: a Buffer owns live heap memory of its length; keys come from its heap's chunk.
unsafe impl Local for Buffer {
    fn local_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn local_len(&self) -> usize {
        self.len()
    }
}
// SAFETY: as above; &mut access is exclusive.
unsafe impl LocalMut for Buffer {}

// SAFETY: a BufSlice borrows live heap memory of its length.
unsafe impl Local for BufSlice<'_> {
    fn local_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn local_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: a slice is valid for its length while borrowed; the key is looked up, never assumed.
unsafe impl Local for [u8] {
    fn local_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn local_len(&self) -> usize {
        self.len()
    }
}
// SAFETY: as above; operations take it by &mut.
unsafe impl LocalMut for [u8] {}

// SAFETY: a RegisteredBuf owns its mapping and its region covers all of it.
unsafe impl Local for RegisteredBuf {
    fn local_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn local_len(&self) -> usize {
        self.len()
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.mr().lkey_in(pd)
    }
}
// SAFETY: as above; registered with whatever access it was given (the NIC checks LOCAL_WRITE).
unsafe impl LocalMut for RegisteredBuf {}

// SAFETY: an owned slice of an IoBuf: valid for its range while borrowed; the key covers the
// whole buffer.
unsafe impl<B: IoBuf> Local for Slice<B> {
    fn local_ptr(&self) -> *const u8 {
        self.stable_ptr()
    }
    fn local_len(&self) -> usize {
        self.bytes_len()
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        IoBuf::lkey_for(self, pd)
    }
}
// SAFETY: as above; the buffer is writable and exclusively ours.
unsafe impl<B: IoBufMut> LocalMut for Slice<B> {}

// SAFETY: a Vec's buffer is valid for its length while the Vec is owned or borrowed; its key is
// looked up in the page map (plain Vecs have keys when `heap::Global` is the process allocator
// and bound), never assumed.
unsafe impl Local for Vec<u8> {
    fn local_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn local_len(&self) -> usize {
        self.len()
    }
}
// SAFETY: as above; operations take it by value or &mut.
unsafe impl LocalMut for Vec<u8> {}

// SAFETY: the memory stays mapped and registered as one region of `mr().pd()` while the value
// lives; no reference to its bytes exists while it is exposed (only atomic copies), so the NIC
// reading or writing them for an operation that borrows the value conflicts with none.
unsafe impl<T: Exposable> Local for RemoteWritable<T> {
    fn local_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn local_len(&self) -> usize {
        self.len()
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.mr().lkey_in(pd)
    }
}
// SAFETY: as above; the registration includes LOCAL_WRITE.
unsafe impl<T: Exposable> LocalMut for RemoteWritable<T> {}
