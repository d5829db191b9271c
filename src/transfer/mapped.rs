//! Memory-mapped files registered for zero-copy file transfer.

use std::fs::{File, OpenOptions};
use std::mem::ManuallyDrop;
use std::ops::RangeBounds;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::request::local::{Local, LocalMut};
use crate::verbs::{Access, Exposable, ExposeFailed, Mr, Pd, RemoteWritable};

/// How a file is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Read-only mapping; peers may RDMA READ it, it can be the source of WRITE and SEND.
    ReadOnly,
    /// Read-write shared mapping, writable here; peers may also RDMA WRITE into it once it is
    /// exposed ([`MappedFile::expose`]).
    ReadWrite,
}

/// A file mapped `MAP_SHARED` and registered as one memory region: its bytes go to and come
/// from the NIC without passing through any buffer.
///
/// ```no_run
/// use mralloc::transfer::{MappedFile, Mode};
/// # let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
/// // SAFETY: nothing else modifies data.bin or copy.bin while they are mapped.
/// let src = unsafe { MappedFile::open("data.bin", Mode::ReadOnly, &pd)? };
/// let dst = unsafe { MappedFile::create("copy.bin", src.len() as u64, &pd)? };
/// // A peer may WRITE into `dst` only once it is exposed: then it lends no `&[u8]`.
/// let dst = dst.expose()?;
/// println!("send {} bytes; the receiver offers {:?}", src.len(), dst.remote());
/// let dst = dst.revoke()?; // the key is dead: the bytes are readable again
/// println!("first byte {:?}", dst.as_slice().first());
/// # Ok::<(), mralloc::Error>(())
/// ```
pub struct MappedFile {
    /// Both taken in Drop: deregistered first, unmapped only if that succeeded.
    mr: ManuallyDrop<Mr>,
    map: ManuallyDrop<FileMap>,
    ptr: *mut u8,
    len: usize,
    mode: Mode,
    _file: File,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile").field("len", &self.len).field("mode", &self.mode).field("mr", &*self.mr).finish()
    }
}

/// Unmaps on drop (only once its registration is gone, see `MappedFile`'s Drop).
struct FileMap(*mut libc::c_void, usize);

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; its registration is already gone (or it never had one).
        unsafe { libc::munmap(self.0, self.1) };
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // SAFETY: both fields are taken exactly once, here, and never used again.
        let (mr, map) = unsafe { (ManuallyDrop::take(&mut self.mr), ManuallyDrop::take(&mut self.map)) };
        crate::verbs::release_registered(mr, map);
    }
}

// SAFETY: the mapping is owned by this value; shared access only reads.
unsafe impl Send for MappedFile {}
// SAFETY: as above.
unsafe impl Sync for MappedFile {}

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

impl MappedFile {
    /// Maps and registers an existing file.
    ///
    /// # Safety
    /// The file's bytes are shared memory: while the `MappedFile` lives, nothing else — another
    /// mapping of the same file in this process (a second `MappedFile` included), another
    /// process, a `write(2)`, a truncation — may modify the mapped range (or, for
    /// [`Mode::ReadWrite`], read it while the NIC or this value writes it). Rust gives out
    /// `&[u8]` views of the bytes and the NIC reads and writes them; a change behind their back
    /// is a data race (the same rule as `memmap2::Mmap::map`).
    ///
    /// # Errors
    /// - [`Error::Io`] if the file cannot be opened, sized or mapped.
    /// - [`Error::InvalidArgument`] for an empty file (or one larger than the address space).
    /// - [`Error::Verbs`] if `ibv_reg_mr` fails (a read-only file refused with `EFAULT` is
    ///   retried as a private mapping first).
    pub unsafe fn open(path: impl AsRef<Path>, mode: Mode, pd: &Pd) -> Result<MappedFile> {
        let path = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .write(mode == Mode::ReadWrite)
            .open(path)
            .map_err(io(format!("opening {}", path.display())))?;
        let len = file.metadata().map_err(io(format!("reading the size of {}", path.display())))?.len();
        MappedFile::map(file, len, mode, pd, path)
    }

    /// Creates (or truncates) `path` with `len` bytes, maps it read-write and registers it; a
    /// peer may RDMA WRITE it once it is exposed ([`MappedFile::expose`]).
    ///
    /// # Safety
    /// As [`MappedFile::open`]: nothing else may access the file's bytes while the value lives.
    ///
    /// # Errors
    /// As [`MappedFile::open`], and [`Error::Io`] if the file cannot be created or sized. The
    /// file is created (truncated) and sized first: a `len` of 0 ([`Error::InvalidArgument`]),
    /// or a failed mapping or registration, leaves it truncated to `len` bytes.
    pub unsafe fn create(path: impl AsRef<Path>, len: u64, pd: &Pd) -> Result<MappedFile> {
        let path = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(io(format!("creating {}", path.display())))?;
        file.set_len(len).map_err(io(format!("sizing {} to {len} bytes", path.display())))?;
        MappedFile::map(file, len, Mode::ReadWrite, pd, path)
    }

    fn map(file: File, len: u64, mode: Mode, pd: &Pd, path: &Path) -> Result<MappedFile> {
        if len == 0 {
            return Err(Error::InvalidArgument(format!("{} is empty: nothing to map", path.display())));
        }
        let len = usize::try_from(len).map_err(|_| Error::InvalidArgument("file too large to map".into()))?;
        let access = match mode {
            // A read-only mapping cannot be registered with LOCAL_WRITE.
            Mode::ReadOnly => Access::REMOTE_READ,
            // Remote write only through `expose`, which lends no references meanwhile.
            Mode::ReadWrite => Access::LOCAL_WRITE | Access::REMOTE_READ,
        };
        let prot = match mode {
            Mode::ReadOnly => libc::PROT_READ,
            Mode::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        };
        match MappedFile::map_register(&file, len, prot, libc::MAP_SHARED, access, pd, path) {
            Ok((mr, map)) => Ok(MappedFile::wrap(mr, map, len, mode, file)),
            // Kernels before 6.2 pin even read-only regions with FOLL_WRITE|FOLL_FORCE, which a
            // read-only shared file mapping refuses (EFAULT). A private read-only mapping can be
            // pinned there: the kernel copies the file's pages once, at registration.
            Err(e) if mode == Mode::ReadOnly && e.errno() == Some(libc::EFAULT) => {
                tracing::debug!("read-only MAP_SHARED registration refused (EFAULT); using MAP_PRIVATE");
                let (mr, map) = MappedFile::map_register(&file, len, prot, libc::MAP_PRIVATE, access, pd, path)?;
                Ok(MappedFile::wrap(mr, map, len, mode, file))
            }
            Err(e) => Err(e),
        }
    }

    fn wrap(mr: Mr, map: FileMap, len: usize, mode: Mode, file: File) -> MappedFile {
        MappedFile { ptr: map.0.cast(), mr: ManuallyDrop::new(mr), map: ManuallyDrop::new(map), len, mode, _file: file }
    }

    fn map_register(
        file: &File,
        len: usize,
        prot: libc::c_int,
        flags: libc::c_int,
        access: Access,
        pd: &Pd,
        path: &Path,
    ) -> Result<(Mr, FileMap)> {
        // SAFETY: a mapping of a file we hold open; the kernel validates fd, length, prot.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, file.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::Io {
                what: format!("mapping {}", path.display()),
                source: std::io::Error::last_os_error(),
            });
        }
        let map = FileMap(p, len);
        // SAFETY: the mapping outlives the Mr (MappedFile's Drop unmaps only after a successful
        // deregistration; on error `map` unmaps after the failed registration); the NIC may write it only with write access, which
        // only read-write (writable) mappings get.
        let mr = unsafe { Mr::register(pd, p.cast(), len, access)? };
        Ok((mr, map))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (empty files are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mapping mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The file's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is len bytes, readable, and lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The file's bytes, writable (read-write mappings only).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the file is mapped [`Mode::ReadOnly`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        if self.mode != Mode::ReadWrite {
            return Err(Error::InvalidArgument("the file is mapped read-only".into()));
        }
        // SAFETY: writable mapping of len bytes; &mut self is exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// The mapping's start, with the mapping's own provenance (not derived from a shared slice).
    pub(crate) fn mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The memory region.
    pub fn mr(&self) -> &Mr {
        &self.mr
    }

    /// What a peer needs to RDMA READ the whole file. The key grants no remote write: a peer
    /// may write a file only once it is exposed ([`MappedFile::expose`]).
    ///
    /// # Errors
    /// Never fails: the whole file is registered, so its keys always exist.
    pub fn remote(&self) -> Result<RemoteBuf> {
        Ok(RemoteBuf { addr: self.ptr as u64, len: self.len as u64, rkey: self.mr.rkey() })
    }

    /// Hands a read-write file to the network: the returned [`RemoteWritable`] carries a key a
    /// peer may RDMA WRITE (and READ) the whole file through, and lends no `&[u8]` to the bytes
    /// meanwhile (the peer may write them at any moment); [`RemoteWritable::revoke`] kills the
    /// key and gives the file back.
    ///
    /// # Errors
    /// With the file back: [`Error::InvalidArgument`] if it is mapped [`Mode::ReadOnly`],
    /// [`Error::Verbs`] if the device refuses the registration.
    #[allow(clippy::result_large_err)] // the error gives the file back, unboxed, as `Rejected` does
    pub fn expose(self) -> std::result::Result<RemoteWritable<MappedFile>, ExposeFailed<MappedFile>> {
        if self.mode != Mode::ReadWrite {
            let error = Error::InvalidArgument("a read-only mapped file cannot be written by a peer".into());
            return Err(ExposeFailed { error, value: self });
        }
        RemoteWritable::expose(self, Access::REMOTE_WRITE | Access::REMOTE_READ)
    }

    /// A range of the file, usable as the local side of any operation.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if `range` is reversed, empty or ends past the file.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<MappedSlice<'_>> {
        let (start, end) = crate::heap::range_of(range, self.len)?;
        if start == end {
            return Err(Error::OutOfBounds { offset: start as u64, len: 0, size: self.len as u64 });
        }
        Ok(MappedSlice { file: self, start, len: end - start })
    }

    /// Writes dirty pages back to the file (`msync(MS_SYNC)`).
    ///
    /// # Errors
    /// [`Error::Io`] if `msync` fails.
    pub fn flush(&self) -> Result<()> {
        // SAFETY: syncing our own mapping.
        if unsafe { libc::msync(self.ptr.cast(), self.len, libc::MS_SYNC) } != 0 {
            return Err(Error::Io { what: "msync".into(), source: std::io::Error::last_os_error() });
        }
        Ok(())
    }
}

/// A range of a [`MappedFile`].
#[derive(Clone, Copy)]
pub struct MappedSlice<'a> {
    file: &'a MappedFile,
    start: usize,
    len: usize,
}

impl MappedSlice<'_> {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.file.as_slice()[self.start..self.start + self.len]
    }

    /// What a peer needs to access this range.
    ///
    /// # Errors
    /// Never fails: the range was checked when the slice was made.
    pub fn remote(&self) -> Result<RemoteBuf> {
        self.file.remote()?.slice(self.start as u64..(self.start + self.len) as u64)
    }
}

// SAFETY: the mapping covers the whole file and is registered as one region in mr.pd().
unsafe impl Local for MappedFile {
    fn local_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn local_len(&self) -> usize {
        self.len
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.mr.lkey_in(pd)
    }
}
// SAFETY: as above; a read-only file's region lacks LOCAL_WRITE, so the NIC refuses to write it
// (a typed completion error), and the CPU cannot reach it mutably (as_mut_slice refuses).
unsafe impl LocalMut for MappedFile {}

// SAFETY: a sub-range of a registered mapping, borrowed from it.
unsafe impl Local for MappedSlice<'_> {
    fn local_ptr(&self) -> *const u8 {
        // SAFETY: start < len of the mapping.
        unsafe { self.file.ptr.add(self.start) }
    }
    fn local_len(&self) -> usize {
        self.len
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.file.lkey_for(pd)
    }
}

impl crate::verbs::sealed::Sealed for MappedFile {
    fn region(&self) -> (*mut u8, usize, &Pd) {
        (self.ptr, self.len, self.mr.pd())
    }
}

impl Exposable for MappedFile {}
