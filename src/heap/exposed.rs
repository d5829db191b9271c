//! `Exposed`: a heap buffer handed to the network, which a peer may write.

use crate::error::{Error, Result};
use crate::heap::buffer::Buffer;
use crate::peer_bytes;
use crate::remote::RemoteBuf;
use crate::remote_desc::RemoteDesc;
use crate::verbs::Pd;

impl Buffer {
    /// Hands the buffer to the network: the returned [`Exposed`] carries a key of its own
    /// (primary PD) with every remote right of [`crate::heap::HeapBuilder::access`] — write,
    /// read, atomics — over exactly the buffer's bytes, as [`Buffer::remote`] describes.
    /// [`Exposed::revoke`] kills the key and gives the buffer back; dropping the `Exposed`
    /// kills it and frees the buffer.
    ///
    /// # Errors
    /// With the buffer back: [`Error::NoRemoteAccess`] if the heap has no remote rights,
    /// [`Error::NotRegistered`] if it is bound to no PD, [`Error::Verbs`] if the device refuses
    /// the registration.
    pub fn expose(self) -> std::result::Result<Exposed, ExposeError> {
        // `primary_pd` refuses a heap without remote rights (NoRemoteAccess) first.
        match self.primary_pd().and_then(|pd| self.key_with(&pd, self.heap_remote_rights())) {
            Ok(remote) => Ok(Exposed { buf: self, remote }),
            Err(error) => Err(ExposeError { error, buf: self }),
        }
    }
}

/// A [`Buffer`] a peer may write: what [`Buffer::expose`] returns.
///
/// A peer with write or atomic rights can change the bytes at any moment, so no Rust
/// reference to them may exist meanwhile: an `Exposed` gives none. It copies in and out with
/// atomic byte accesses ([`Exposed::read_into`], [`Exposed::write_from`]) and gives the
/// [`Buffer`] back with [`Exposed::revoke`], once the peer's key is dead. Dropping it revokes
/// the key and frees the buffer; forgetting it leaks the buffer (the key stays valid, but the
/// memory is never reused).
///
/// ```no_run
/// # fn f(heap: &mralloc::heap::Heap) -> mralloc::Result<()> {
/// let inbox = heap.alloc(4096)?.expose()?;
/// let offer = inbox.remote().to_bytes(); // send to the peer; it RDMA-WRITEs into the inbox
/// // ... once the peer says it is done (a SEND, an immediate):
/// let inbox = inbox.revoke()?; // its key is dead: the bytes are ours again
/// println!("{:?}", &inbox[..16]);
/// # Ok(()) }
/// ```
pub struct Exposed {
    buf: Buffer,
    remote: RemoteBuf,
}

/// [`Buffer::expose`] failed: why, and the buffer back.
#[derive(Debug)]
pub struct ExposeError {
    /// What went wrong.
    pub error: Error,
    /// The buffer, unexposed.
    pub buf: Buffer,
}

impl From<ExposeError> for Error {
    fn from(e: ExposeError) -> Error {
        e.error
    }
}

impl std::fmt::Display for ExposeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for ExposeError {}

impl Exposed {
    /// What the peer needs: address, length and this buffer's own rkey (primary PD).
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// A key for a peer that reaches this host through `pd`'s device (a registration of its
    /// own per PD, with the same rights).
    ///
    /// # Errors
    /// [`Error::Verbs`] if the device refuses the registration.
    pub fn remote_for(&self, pd: &Pd) -> Result<RemoteBuf> {
        self.buf.key_with(pd, self.buf.heap_remote_rights())
    }

    /// [`Exposed::remote_for`] on every device the heap is bound to, in one descriptor a peer
    /// reaches the buffer through over any of them (see [`Buffer::remote_desc`]; here with the
    /// heap's remote rights). A device that already has this buffer's registration (the one
    /// [`Exposed::remote`] names) gets no second one: its key is the same. [`Exposed::revoke`] and
    /// the drop remove every registration.
    ///
    /// # Errors
    /// As [`Buffer::remote_desc`], without [`Error::NoRemoteAccess`] (an `Exposed` has rights).
    pub fn desc(&self) -> Result<RemoteDesc> {
        self.buf.desc_with(self.buf.heap_remote_rights())
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.size()
    }

    /// Whether the buffer is empty (never: heaps refuse empty allocations).
    pub fn is_empty(&self) -> bool {
        self.buf.size() == 0
    }

    /// The first byte, for volatile or atomic access of the caller's own (reads and writes;
    /// the pointer is not derived from a reference).
    pub fn as_ptr(&self) -> *mut u8 {
        self.buf.raw().as_ptr()
    }

    /// Copies `out.len()` bytes starting at `offset` out of the buffer, with relaxed atomic
    /// byte loads: a snapshot that may interleave with the peer's (and other threads')
    /// writes.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range does not fit.
    pub fn read_into(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        // SAFETY: the live allocation, which outlives &self; while exposed every access to it
        // is atomic (here and in write_from) or the NIC's: no reference to the bytes exists.
        unsafe { peer_bytes::copy_out(self.as_ptr(), self.len(), offset, out) }
    }

    /// The whole buffer, copied out with atomic byte loads ([`Exposed::read_into`]).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        self.read_into(0, &mut v).expect("the whole buffer is in bounds");
        v
    }

    /// Copies `src` into the buffer at `offset`, with relaxed atomic byte stores (a peer
    /// reading meanwhile may see part of it).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range does not fit.
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: as in read_into.
        unsafe { peer_bytes::copy_in(self.as_ptr(), self.len(), offset, src) }
    }

    /// Revokes every key of the buffer (once this returns, each remote access fails at the
    /// peer with a remote access error) and gives the buffer back.
    ///
    /// # Errors
    /// [`Error::Verbs`] or [`Error::RevocationFailed`] if the device refused to remove a
    /// registration: the peer may still reach the bytes, so the buffer is leaked (never freed,
    /// never reused) instead of returned.
    pub fn revoke(self) -> Result<Buffer> {
        let mut buf = self.buf;
        // On an error, dropping `buf` retries and, as the registration stays, leaks the memory.
        buf.revoke_remote()?;
        Ok(buf)
    }
}

impl std::fmt::Debug for Exposed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposed").field("remote", &self.remote).finish()
    }
}
