//! Anonymous memory mappings: the page-aligned backing store for registered memory.

use std::ptr::NonNull;

use crate::error::{Error, Result};

/// An owned anonymous private mapping, unmapped on drop.
///
/// Registered memory must not be moved, reused or returned to the OS while a memory region
/// covers it; owners therefore drop their [`crate::verbs::Mr`] before the `Mapping` (declare the
/// `Mr` field first).
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is plain memory owned by one value; moving it between threads is fine.
unsafe impl Send for Mapping {}
// SAFETY: shared access only hands out `*const`/`&[u8]` views guarded by the owner.
unsafe impl Sync for Mapping {}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Keeps `[base, base+len)` (a private anonymous mapping) out of `fork()` children without
/// leaving a hole there: `MADV_WIPEONFORK` gives the child fresh zero pages at the same
/// addresses and leaves the parent's (pinned) pages alone — no copy-on-write, nothing copied.
/// On kernels before 4.14, `MADV_DONTFORK` (the child then has no mapping there).
pub(crate) fn exclude_from_fork(base: usize, len: usize) {
    // SAFETY: advice on a mapping the caller owns; neither changes the parent's contents.
    unsafe {
        if libc::madvise(base as *mut libc::c_void, len, libc::MADV_WIPEONFORK) != 0
            && libc::madvise(base as *mut libc::c_void, len, libc::MADV_DONTFORK) != 0
        {
            tracing::debug!("madvise(MADV_DONTFORK) failed: {}", std::io::Error::last_os_error());
        }
    }
}

impl Mapping {
    /// Maps `len` bytes (rounded up to whole pages, at least one page) of zeroed memory.
    /// The pages are kept out of `fork()` children ([`exclude_from_fork`]), as pinned DMA memory
    /// must be: a child touching them would otherwise trigger copy-on-write in the parent.
    pub(crate) fn anonymous(len: usize) -> Result<Mapping> {
        let page = page_size();
        let rounded = len
            .max(1)
            .checked_next_multiple_of(page)
            .ok_or_else(|| Error::InvalidArgument(format!("mapping of {len} bytes overflows the address space")))?;
        // SAFETY: anonymous private mapping with no fixed address; the kernel validates the size.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                rounded,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Io {
                what: format!("mmap of {rounded} bytes"),
                source: std::io::Error::last_os_error(),
            });
        }
        exclude_from_fork(p as usize, rounded);
        Ok(Mapping { ptr: NonNull::new(p.cast()).expect("mmap returned NULL without MAP_FAILED"), len: rounded })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping we own; nothing refers to it once its owner drops.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_pages_and_is_zeroed() {
        let m = Mapping::anonymous(10).unwrap();
        assert_eq!(m.len(), page_size());
        assert_eq!(m.as_ptr() as usize % page_size(), 0);
        // SAFETY: the mapping is readable and m.len() bytes long.
        let s = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert!(s.iter().all(|&b| b == 0));
    }

    #[test]
    fn absurd_size_is_an_error() {
        assert!(Mapping::anonymous(usize::MAX).is_err());
        assert!(Mapping::anonymous(1 << 60).is_err());
    }
}
