//! `RemoteWritable`: registered memory of one's own (a [`RegisteredBuf`], a read-write
//! [`MappedFile`](crate::transfer::MappedFile)) handed to the network with a key a peer may
//! write through — and, while that key lives, no references to its bytes.

use std::mem::ManuallyDrop;

use crate::error::{Error, Result};
use crate::peer_bytes;
use crate::remote::RemoteBuf;
use crate::verbs::{keep_for_good, Access, Mr, Pd, RegisteredBuf};

pub(crate) mod sealed {
    use crate::verbs::Pd;

    /// Implemented only inside the crate.
    pub trait Sealed {
        /// Start, length and PD of the memory (stable while the value lives; the pointer has
        /// the mapping's provenance, not a reference's).
        fn region(&self) -> (*mut u8, usize, &Pd);
    }
}

/// Memory that can be handed to the network as a [`RemoteWritable`]: a [`RegisteredBuf`], or a
/// read-write [`MappedFile`](crate::transfer::MappedFile). Sealed.
pub trait Exposable: sealed::Sealed + Sized {}

/// Memory of one's own that a peer may write (and read, or use atomics on) at any moment: it
/// carries a registration of exactly its bytes with the asked remote rights, and gives **no**
/// `&[u8]`/`&mut [u8]` to them — only copies made with atomic byte accesses
/// ([`RemoteWritable::read_into`], [`RemoteWritable::to_vec`], [`RemoteWritable::write_from`]).
/// It can be the local side of any blocking operation (the NIC may read and write it; the CPU
/// holds no reference meanwhile). [`RemoteWritable::revoke`] deregisters the key and gives the
/// memory back with its references; dropping deregisters and frees.
///
/// Made by [`RegisteredBuf::expose`] and
/// [`MappedFile::expose`](crate::transfer::MappedFile::expose). Why not references: the Rust
/// rules for `&[u8]` forbid any write to the bytes while the reference lives, and a peer's
/// RDMA WRITE through a live key is exactly such a write.
pub struct RemoteWritable<T: Exposable> {
    /// Both taken in Drop: deregistered first; the memory freed only if that succeeded.
    mr: ManuallyDrop<Mr>,
    inner: ManuallyDrop<T>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the value owns the memory and the registration; its bytes are only accessed
// atomically or by the NIC; `T` itself moves between threads under its own bounds.
unsafe impl<T: Exposable + Send> Send for RemoteWritable<T> {}
// SAFETY: `&self` gives only atomic byte accesses and immutable registration fields.
unsafe impl<T: Exposable + Sync> Sync for RemoteWritable<T> {}

/// An expose that failed: why, and the value back.
#[derive(Debug)]
pub struct ExposeFailed<T> {
    /// Why.
    pub error: Error,
    /// The value, untouched.
    pub value: T,
}

impl<T> std::fmt::Display for ExposeFailed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.error)
    }
}

impl<T: std::fmt::Debug> std::error::Error for ExposeFailed<T> {}

impl<T> From<ExposeFailed<T>> for Error {
    fn from(e: ExposeFailed<T>) -> Error {
        e.error
    }
}

impl<T: Exposable> RemoteWritable<T> {
    /// Registers all of `inner` with `access` (at least one remote right; `LOCAL_WRITE` is
    /// always added).
    pub(crate) fn expose(inner: T, access: Access) -> std::result::Result<RemoteWritable<T>, ExposeFailed<T>> {
        if access.remote_only().is_empty() || !Access::ALL_REMOTE.contains(access) {
            let error = Error::InvalidArgument(format!(
                "exposing takes remote rights (REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC; LOCAL_WRITE is always \
                 added), got {access:?}"
            ));
            return Err(ExposeFailed { error, value: inner });
        }
        let (ptr, len, pd) = sealed::Sealed::region(&inner);
        // SAFETY: `inner`'s memory is valid for `len` bytes and stays mapped while the returned
        // value lives (it owns `inner`, and frees it only after a successful deregistration,
        // leaking it otherwise); no reference to the bytes is handed out while registered.
        match unsafe { Mr::register(pd, ptr, len, access | Access::LOCAL_WRITE) } {
            Ok(mr) => Ok(RemoteWritable { mr: ManuallyDrop::new(mr), inner: ManuallyDrop::new(inner), ptr, len }),
            Err(error) => Err(ExposeFailed { error, value: inner }),
        }
    }

    /// What a peer needs: the whole memory under the remote key.
    pub fn remote(&self) -> RemoteBuf {
        RemoteBuf { addr: self.ptr as u64, len: self.len as u64, rkey: self.mr.rkey() }
    }

    /// The registration carrying the remote rights (its `lkey` serves local operations too).
    pub fn mr(&self) -> &Mr {
        &self.mr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (empty memory cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for volatile or atomic accesses of the caller's own (not derived from a
    /// reference).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Copies `out.len()` bytes at `offset` out, with relaxed atomic byte loads: a snapshot that
    /// may interleave with the peer's writes.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range does not fit.
    pub fn read_into(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        // SAFETY: the memory lives as long as self; while exposed it is only accessed
        // atomically (here, write_from) or by the NIC.
        unsafe { peer_bytes::copy_out(self.ptr, self.len, offset, out) }
    }

    /// All the bytes, copied out ([`RemoteWritable::read_into`]).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.read_into(0, &mut v).expect("the whole range is in bounds");
        v
    }

    /// Copies `src` in at `offset`, with relaxed atomic byte stores.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range does not fit.
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: as in read_into; the memory is writable (registered with LOCAL_WRITE).
        unsafe { peer_bytes::copy_in(self.ptr, self.len, offset, src) }
    }

    /// Deregisters the remote key (once this returns, every access through it fails at the
    /// peer) and gives the memory back, with its references.
    ///
    /// # Errors
    /// [`Error::Verbs`] if the device refused to deregister (the key may still work): the
    /// memory is then leaked — never freed, never handed back. [`Error::Forked`] in a fork()ed
    /// child (the registration is the parent's): the child's copy is leaked.
    pub fn revoke(self) -> Result<T> {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: both fields are taken exactly once (`this` is never dropped).
        let (mr, inner) = unsafe { (ManuallyDrop::take(&mut this.mr), ManuallyDrop::take(&mut this.inner)) };
        match mr.deregister() {
            Ok(()) => Ok(inner),
            Err(e) => {
                leak(inner, &e);
                Err(e)
            }
        }
    }
}

impl<T: Exposable> Drop for RemoteWritable<T> {
    fn drop(&mut self) {
        // SAFETY: both fields are taken exactly once, here.
        let (mr, inner) = unsafe { (ManuallyDrop::take(&mut self.mr), ManuallyDrop::take(&mut self.inner)) };
        if let Err(e) = mr.deregister() {
            leak(inner, &e);
        }
    }
}

/// Keeps `inner` for good: its remote key could not be removed (`e`), so the peer may still
/// reach the memory. A fork()ed child's copy (the registration is the parent's) is kept too,
/// silently.
fn leak<T>(inner: T, e: &Error) {
    if matches!(e, Error::Forked(_)) {
        std::mem::forget(inner);
    } else {
        keep_for_good(inner, format_args!("deregistering remotely writable memory failed: {e}; the memory is leaked"));
    }
}

impl<T: Exposable> std::fmt::Debug for RemoteWritable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteWritable").field("remote", &self.remote()).field("access", &self.mr.access()).finish()
    }
}

impl sealed::Sealed for RegisteredBuf {
    fn region(&self) -> (*mut u8, usize, &Pd) {
        (self.map_ptr(), self.byte_len(), self.mr().pd())
    }
}

impl Exposable for RegisteredBuf {}
