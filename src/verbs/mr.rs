//! Memory regions: registering memory with a PD, and owned registered buffers.

use std::ops::{Deref, DerefMut, Range};
use std::time::Instant;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::mmap::Mapping;
use crate::verbs::{ExposeFailed, Pd, RemoteAddr, RemoteWritable, Sge};

bitflags::bitflags! {
    /// Access rights of a memory region (`IBV_ACCESS_*`), a set of flags: combine them with
    /// `|`; they print by name (`Access(LOCAL_WRITE | REMOTE_WRITE)`).
    ///
    /// Local read is always allowed. [`Access::LOCAL_WRITE`] is needed for anything the NIC
    /// writes locally (RDMA READ targets, receive buffers, atomics results); the remote rights
    /// must be asked for explicitly.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local NIC may write (receives, READ targets).
        const LOCAL_WRITE = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        /// Peers may RDMA WRITE into the region.
        const REMOTE_WRITE = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        /// Peers may RDMA READ from the region.
        const REMOTE_READ = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        /// Peers may perform atomics on the region.
        const REMOTE_ATOMIC = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        /// Memory windows may be bound to the region.
        const MW_BIND = ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0;
        /// Local write plus every remote right: what a buffer exposed to a trusted peer needs.
        /// (It includes `LOCAL_WRITE`; [`Access::remote_only`] strips it.)
        const ALL_REMOTE = Self::LOCAL_WRITE.bits()
            | Self::REMOTE_WRITE.bits()
            | Self::REMOTE_READ.bits()
            | Self::REMOTE_ATOMIC.bits();
    }
}

impl Default for Access {
    /// [`Access::NONE`].
    fn default() -> Access {
        Access::NONE
    }
}

impl Access {
    /// No rights beyond local read (the empty set).
    pub const NONE: Access = Access::empty();

    /// The remote rights (write, read, atomic).
    const REMOTE: Access = Access::REMOTE_WRITE.union(Access::REMOTE_READ).union(Access::REMOTE_ATOMIC);

    /// Whether any remote right is included.
    pub const fn is_remote(self) -> bool {
        self.intersects(Access::REMOTE)
    }

    /// Only the remote rights of `self` (write, read, atomic): what a queue pair can be given.
    pub const fn remote_only(self) -> Access {
        self.intersection(Access::REMOTE)
    }

    /// `self` without its remote rights (local write, window binding).
    pub const fn without_remote(self) -> Access {
        self.difference(Access::REMOTE)
    }
}

/// A registered memory region (`ibv_mr`): the NIC may access `[addr, addr+len)` with these keys.
///
/// Deregistered on drop. It keeps its [`Pd`] alive, so it can never outlive it.
pub struct Mr {
    mr: *mut ffi::ibv_mr,
    access: Access,
    pd: Pd,
}

// SAFETY: an ibv_mr is immutable after registration and may be used (its keys read, its
// deregistration called) from any thread.
unsafe impl Send for Mr {}
// SAFETY: see Send; &Mr only reads immutable fields.
unsafe impl Sync for Mr {}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access)
            .finish()
    }
}

impl Mr {
    /// Registers `[addr, addr+len)` with `pd`.
    ///
    /// # Safety
    /// The range must be memory of this process that stays mapped, and is not handed to anyone
    /// else for reuse, until the returned `Mr` is deregistered — use [`Mr::deregister`] and keep
    /// the memory forever if it fails (dropping an `Mr` whose deregistration fails leaves the
    /// region registered) — **and** no posted work request that uses it can still be executed
    /// by the NIC. With remote rights, peers may write the range at
    /// any time while the region lives: the caller must treat it as shared with the network.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `len` is 0.
    /// - [`Error::Verbs`] if `ibv_reg_mr` fails (its hint names the memlock limit for `ENOMEM`,
    ///   `EPERM` and `EAGAIN`).
    /// - [`Error::DeviceRemoved`] once the device was found removed
    ///   ([`Context::is_removed`](crate::verbs::Context::is_removed)).
    pub unsafe fn register(pd: &Pd, addr: *mut u8, len: usize, access: Access) -> Result<Mr> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot register an empty memory range".into()));
        }
        pd.context().usable_for_new()?;
        let started = Instant::now();
        // SAFETY: pd is live; the caller guarantees the range is valid memory (function
        // contract). ibv_reg_mr validates the range and access bits and returns NULL on error.
        let mr = unsafe { ffi::ibv_reg_mr(pd.as_raw(), addr.cast(), len, access.bits() as i32) };
        if mr.is_null() {
            return Err(Error::verbs("ibv_reg_mr", 0));
        }
        tracing::trace!(len, elapsed_us = started.elapsed().as_micros() as u64, "ibv_reg_mr");
        Ok(Mr { mr, access, pd: pd.clone() })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        // SAFETY: mr is a live registration; its fields are immutable.
        unsafe { (*self.mr).addr as u64 }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: as in addr().
        unsafe { (*self.mr).length }
    }

    /// Never true: empty ranges cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Local key, for scatter/gather entries posted on this side.
    pub fn lkey(&self) -> u32 {
        // SAFETY: as in addr().
        unsafe { (*self.mr).lkey }
    }

    /// Remote key, for peers addressing this region.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as in addr().
        unsafe { (*self.mr).rkey }
    }

    /// The rights it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The PD it belongs to.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// The local key, if this region belongs to `pd` (what an operation on a connection in
    /// `pd` needs).
    ///
    /// # Errors
    /// Returns `None` if the region belongs to another PD.
    pub fn lkey_in(&self, pd: &Pd) -> Option<u32> {
        (self.pd() == pd).then(|| self.lkey())
    }

    /// The raw `ibv_mr`, valid while this `Mr` lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.mr
    }

    fn check(&self, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::InvalidArgument(format!(
                "range {}..{} is outside the {}-byte memory region",
                range.start,
                range.end,
                self.len()
            )));
        }
        if range.end - range.start > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "a scatter/gather entry holds at most 4 GiB, got {} bytes",
                range.end - range.start
            )));
        }
        Ok(())
    }

    /// A scatter/gather entry for `range` (byte offsets into the region), bounds-checked.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `range` is reversed or ends past the region, or is longer
    /// than 4 GiB (`u32::MAX` bytes).
    pub fn sge(&self, range: Range<usize>) -> Result<Sge> {
        self.check(&range)?;
        Ok(Sge::new(self.addr() + range.start as u64, (range.end - range.start) as u32, self.lkey()))
    }

    /// The remote address of `offset` within the region, for a peer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `offset` is past the end of the region (the end itself is
    /// accepted).
    pub fn remote(&self, offset: usize) -> Result<RemoteAddr> {
        self.check(&(offset..offset))?;
        Ok(RemoteAddr { addr: self.addr() + offset as u64, rkey: self.rkey() })
    }
}

impl Mr {
    /// Deregisters the region now and says whether the device let go of it.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_dereg_mr` fails (rxe refuses while a memory window is bound to
    /// the region): the region stays registered — and may still be accessed through its keys
    /// or windows — so its memory must stay mapped and must not be reused (leak it).
    pub fn deregister(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        this.pd.context().usable()?;
        // SAFETY: mr came from ibv_reg_mr and is deregistered once: `this` is never dropped.
        let rc = unsafe { ffi::ibv_dereg_mr(this.mr) };
        // SAFETY: the Pd clone is dropped exactly once, here (`this` is ManuallyDrop).
        drop(unsafe { std::ptr::read(&this.pd) });
        if rc != 0 {
            return Err(Error::verbs("ibv_dereg_mr", rc));
        }
        Ok(())
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if !self.pd.context().owned_here() {
            return; // the parent's (a fork()ed child's copy)
        }
        // SAFETY: mr came from ibv_reg_mr and is deregistered exactly once; the PD is still
        // alive because we hold a clone.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            // The memory must now stay mapped; owners that can leak it use `Mr::deregister`.
            tracing::error!(rc, "ibv_dereg_mr failed: the region stays registered");
        }
    }
}

/// Deregisters `mr`, then unmaps `map` — or, if the device refused to let go of the region,
/// leaks the mapping (unmapping pinned, still-registered memory would let the NIC reach pages
/// the kernel reuses).
pub(crate) fn release<M>(mr: Mr, map: M) {
    if !mr.pd.context().owned_here() {
        // A fork()ed child's copy: the region is the parent's (and the mapping may not even be
        // in the child). Nothing to release, nothing to report.
        std::mem::forget((mr, map));
        return;
    }
    match mr.deregister() {
        Ok(()) => drop(map),
        Err(e) => keep_for_good(map, format_args!("{e}: leaking the registered mapping")),
    }
}

/// Keeps `value` for good: a registration (or queue) naming its memory could not be removed,
/// so the NIC or a peer may still reach it. Leaked before anything else runs (a logger may
/// panic), counted in [`leaked_mappings`](crate::verbs::leaked_mappings), logged as an error
/// saying `why`.
pub(crate) fn keep_for_good<T>(value: T, why: std::fmt::Arguments<'_>) {
    std::mem::forget(value);
    LEAKED_MAPPINGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::error!("{why}");
}

/// Mappings kept because their registration could not be removed (process-wide).
pub(crate) static LEAKED_MAPPINGS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Zeroed, page-aligned memory of its own, registered with a PD: the simplest safe way to get
/// bytes the NIC can use. (The registered heap, [`crate::heap`], is the scalable way.)
///
/// It derefs to `[u8]`, so no peer may write it: [`RegisteredBuf::new`] refuses remote-write
/// rights. A buffer a peer writes is exposed first, and lends no references until revoked:
///
/// ```no_run
/// # fn f(pd: &mralloc::verbs::Pd, peer: &mralloc::transfer::Connection, src: &mralloc::Buffer) -> mralloc::Result<()> {
/// use mralloc::verbs::{Access, RegisteredBuf};
/// let inbox = RegisteredBuf::new(pd, 4096, Access::LOCAL_WRITE)?.expose(Access::REMOTE_WRITE)?;
/// // `inbox.remote()` is what a peer is sent; here the far end of a loopback pair writes.
/// peer.write(&src[..8], &inbox.remote(), 0)?;
/// println!("while exposed, only copies: {:?}", &inbox.to_vec()[..8]);
/// let inbox = inbox.revoke()?; // the key is dead: the bytes are ours again
/// println!("{:?}", &inbox[..8]);
/// # Ok(()) }
/// ```
///
/// ```no_run
/// use mralloc::verbs::{Access, Context, Pd, RegisteredBuf};
/// let ctx = Context::open_default()?;
/// let pd = Pd::new(&ctx)?;
/// let mut buf = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE)?;
/// buf[..5].copy_from_slice(b"hello");
/// println!("lkey {:#x} rkey {:#x}", buf.mr().lkey(), buf.mr().rkey());
/// # Ok::<(), mralloc::Error>(())
/// ```
pub struct RegisteredBuf {
    /// Both taken in Drop: deregistered first, the mapping unmapped only if that succeeded.
    mr: std::mem::ManuallyDrop<Mr>,
    map: std::mem::ManuallyDrop<Mapping>,
    len: usize,
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        // SAFETY: both fields are taken exactly once, here, and never used again.
        let (mr, map) =
            unsafe { (std::mem::ManuallyDrop::take(&mut self.mr), std::mem::ManuallyDrop::take(&mut self.map)) };
        release(mr, map);
    }
}

impl RegisteredBuf {
    /// Maps `len` zeroed bytes and registers them with `pd` with `access`: local rights
    /// ([`Access::LOCAL_WRITE`]) and, if asked, [`Access::REMOTE_READ`] — rights under which
    /// no peer can write the bytes while `Deref`/`DerefMut` lend them out. Memory a peer may
    /// write comes from [`RegisteredBuf::expose`], which lends no references.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `access` includes [`Access::REMOTE_WRITE`],
    ///   [`Access::REMOTE_ATOMIC`] or [`Access::MW_BIND`] (a window could grant remote writes),
    ///   or if `len` is 0 or too large to round up to whole pages.
    /// - [`Error::Io`] if `mmap` fails.
    /// - [`Error::Verbs`] if `ibv_reg_mr` fails (e.g. the memlock limit; the error's hint says so).
    pub fn new(pd: &Pd, len: usize, access: Access) -> Result<RegisteredBuf> {
        let writable = Access::REMOTE_WRITE | Access::REMOTE_ATOMIC | Access::MW_BIND;
        if access.intersects(writable) {
            return Err(Error::InvalidArgument(format!(
                "RegisteredBuf::new lends references to its bytes, so no peer may write them: {:?} \
                 is refused; register locally and use RegisteredBuf::expose",
                access & writable
            )));
        }
        RegisteredBuf::with_any_access(pd, len, access)
    }

    /// [`RegisteredBuf::new`] without the check of `access` (crate tests of windows on it).
    pub(crate) fn with_any_access(pd: &Pd, len: usize, access: Access) -> Result<RegisteredBuf> {
        if len == 0 {
            return Err(Error::InvalidArgument("a registered buffer needs at least one byte".into()));
        }
        let map = Mapping::anonymous(len)?;
        // SAFETY: the mapping is ours, stays mapped until the Mr is deregistered (Drop: and
        // forever if that fails), and is never handed to anyone else.
        let mr = unsafe { Mr::register(pd, map.as_ptr(), map.len(), access)? };
        Ok(RegisteredBuf { mr: std::mem::ManuallyDrop::new(mr), map: std::mem::ManuallyDrop::new(map), len })
    }

    /// The memory region covering the buffer.
    pub fn mr(&self) -> &Mr {
        &self.mr
    }

    /// Hands the buffer to the network with a key of its own carrying `access` (remote rights:
    /// write, read, atomics): the returned [`RemoteWritable`] gives no references to the bytes
    /// while a peer may write them; [`RemoteWritable::revoke`] gives the buffer back.
    ///
    /// # Errors
    /// With the buffer back: [`Error::InvalidArgument`] if `access` holds no remote right, or
    /// a right other than the remote ones and `LOCAL_WRITE` (which is always added), such as
    /// `MW_BIND`; [`Error::Verbs`] if the device refuses the registration.
    pub fn expose(self, access: Access) -> std::result::Result<RemoteWritable<RegisteredBuf>, ExposeFailed<Self>> {
        RemoteWritable::expose(self, access)
    }

    /// The start of the mapping, with the mapping's own provenance (not derived from a shared
    /// slice), for memory the NIC writes while only `&self` is held.
    pub(crate) fn map_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// The length, without making a reference to the bytes.
    pub(crate) fn byte_len(&self) -> usize {
        self.len
    }

    /// A scatter/gather entry for `range` of the buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `range` is reversed or ends past the buffer's length, or is
    /// longer than 4 GiB.
    pub fn sge(&self, range: Range<usize>) -> Result<Sge> {
        if range.end > self.len {
            return Err(Error::InvalidArgument(format!(
                "range {}..{} is outside the {}-byte buffer",
                range.start, range.end, self.len
            )));
        }
        self.mr.sge(range)
    }
}

impl Deref for RegisteredBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping is at least len bytes, initialised (zeroed), and lives as long as
        // self. No peer can write it (`new` refuses remote-write, atomic and window rights; an
        // exposed buffer is a RemoteWritable, which has no Deref); the local NIC writes it only
        // for an operation that borrows it mutably, or one posted with an unsafe call whose
        // contract forbids overlapping CPU access.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.len) }
    }
}

impl DerefMut for RegisteredBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive CPU access.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuf").field("len", &self.len).field("mr", &self.mr).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_compose() {
        let a = Access::LOCAL_WRITE | Access::REMOTE_READ;
        assert!(a.contains(Access::LOCAL_WRITE));
        assert!(!a.contains(Access::REMOTE_WRITE));
        assert!(a.is_remote());
        assert!(!Access::LOCAL_WRITE.is_remote());
        assert!(Access::ALL_REMOTE.contains(a));
        assert_eq!(
            Access::ALL_REMOTE.remote_only(),
            Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
        );
        assert_eq!((Access::LOCAL_WRITE | Access::MW_BIND).remote_only(), Access::NONE);
        assert_eq!(Access::LOCAL_WRITE.bits(), 1);
    }
}
