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

use crate::os::page_size;

impl Mapping {
    /// Maps `len` bytes (rounded up to whole pages, at least one page) of zeroed memory, prepared
    /// for `fork()` as registered memory must be ([`crate::fork::advise_fork`]: a child gets a copy where the
    /// kernel copies pinned pages, otherwise nothing — never a page shared copy-on-write with the
    /// parent, whose first write would then move the page away from the NIC's). Not for
    /// jemalloc's hooks: the process's first call decides the fork policy, which may allocate.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `len` rounded to pages overflows; [`Error::Io`] if `mmap`
    /// fails, or `madvise(MADV_DONTFORK)` where that advice is needed.
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
        if let Err(errno) = crate::fork::advise_fork(p as usize, rounded) {
            // SAFETY: the mapping just made, referenced by nothing.
            unsafe { libc::munmap(p, rounded) };
            return Err(Error::Io {
                what: format!("madvise(MADV_DONTFORK) of a {rounded}-byte registered mapping"),
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
        crate::fork::report_unrecorded_holes();
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
        crate::fork::forget_fork(self.ptr.as_ptr() as usize, self.len);
    }
}

#[cfg(test)]
pub(crate) mod tests {
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

    /// The `VmFlags` of the mapping containing `addr`, from /proc/self/smaps.
    pub(crate) fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((lo, rest)) = line.split_once('-') {
                if let (Ok(lo), Some(hi)) = (usize::from_str_radix(lo, 16), rest.split_whitespace().next()) {
                    if let Ok(hi) = usize::from_str_radix(hi, 16) {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.trim().to_owned();
                }
            }
        }
        panic!("no mapping at {addr:#x}");
    }

    /// Registered memory gets no fork advice where children get copies (this project's hosts),
    /// and `MADV_DONTFORK` (`dc`) where they do not; never `MADV_WIPEONFORK` (`wf`).
    #[test]
    fn a_mapping_gets_the_processes_fork_advice() {
        let m = Mapping::anonymous(3 * page_size()).unwrap();
        let flags = vm_flags(m.as_ptr() as usize);
        let words: Vec<&str> = flags.split_whitespace().collect();
        assert!(!words.contains(&"wf"), "{flags}");
        if crate::fork::children_copy_pinned_pages() {
            assert!(!words.contains(&"dc"), "{flags}");
        } else {
            assert!(words.contains(&"dc"), "{flags}");
        }
    }

    #[test]
    fn absurd_size_is_an_error() {
        assert!(Mapping::anonymous(usize::MAX).is_err());
        assert!(Mapping::anonymous(1 << 60).is_err());
    }
}
