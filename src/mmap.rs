//! Anonymous memory mappings: the page-aligned backing store for registered memory.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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

/// Prepares `[base, base+len)` (a private anonymous mapping about to hold registered memory)
/// for `fork()`, as [`crate::fork`] explains: where the kernel copies pinned pages into a child
/// (Linux 5.13+), nothing — the child gets a copy of the bytes. Otherwise the range is recorded
/// and marked `MADV_DONTFORK`: the child has no mapping there, and its fork handler maps an
/// inaccessible reservation over it ([`reserve_fork_holes`]). Never `MADV_WIPEONFORK`: zero
/// pages in place of typed values (a `NonZeroU64`, a `Box`, a `String`) are undefined
/// behaviour in the child. Call [`forget_fork`] after unmapping the range.
///
/// # Errors
/// The errno of a failed `madvise(MADV_DONTFORK)` (the record is dropped again): the range
/// would be shared copy-on-write with children, so the caller must not use it as registered
/// memory.
///
/// No allocation and no lock (it runs inside jemalloc's extent hooks) once the process has
/// decided ([`crate::fork::children_copy_pinned_pages`], whose first call may allocate: owners
/// make it in `Owner::new`) and installed its fork handler (every owner has: `Born::now`).
pub(crate) fn advise_fork(base: usize, len: usize) -> std::result::Result<(), i32> {
    if crate::fork::children_copy_pinned_pages() {
        return Ok(());
    }
    // The child's handler must run in every child from now on.
    crate::fork::install();
    HOLES.keep_out(base, len)
}

/// Logs a warning if ranges were kept out of fork children without a record since the last
/// report (the table of [`MAX_HOLES`] ranges was full): a child has plain holes there, which
/// fault but may be mapped over by the child. Outside jemalloc's hooks only (logging may
/// allocate): called after a registered buffer is mapped and by a heap's slow paths once
/// jemalloc returned (`heap::events::emit_pending`).
pub(crate) fn report_unrecorded_holes() {
    if let Some(overflows) = HOLES.unreported_overflows() {
        tracing::warn!(
            unrecorded = overflows,
            table = MAX_HOLES,
            "more registered ranges than mralloc's fork record holds: a fork()ed child gets plain holes, not reservations, for some of them (it must not map memory there and expect the parent's values)"
        );
    }
}

/// Drops the fork record of `[base, base+len)` ([`advise_fork`]) once it is unmapped. (A fork
/// between the unmap and this finds the range free and reserves it in the child: harmless, the
/// child owns nothing there.) A range that was never recorded is ignored. No allocation, no lock.
pub(crate) fn forget_fork(base: usize, len: usize) {
    if crate::fork::decided_copies() == Some(false) {
        HOLES.forget(base, len);
    }
}

/// In a fork()ed child, where registered ranges are kept out of children: maps a `PROT_NONE`
/// reservation over every range the parent had marked `MADV_DONTFORK` ([`advise_fork`]), so a
/// child touching a parent's value faults, and nothing the child maps later lands there. Never
/// replaces a mapping (`MAP_FIXED_NOREPLACE`): a part that is mapped (a range recorded but not yet
/// advised at the fork) is left as it is. Runs in the fork handler: no allocation, no lock.
pub(crate) fn reserve_fork_holes() {
    if crate::fork::decided_copies() == Some(false) {
        HOLES.reserve_all();
    }
}

/// Ranges recorded at once; more are still kept out of children, unreserved (counted in
/// `Holes::overflows`, reported by [`report_unrecorded_holes`]). (1 MiB of zeroed, untouched
/// memory until used; scanned up to the highest slot ever used.)
const MAX_HOLES: usize = 1 << 16;

/// The ranges marked `MADV_DONTFORK`: a fixed table of atomics (never on a heap; the extent
/// hooks and the fork handler use it). A slot is free while `base` is 0; `len` is set after
/// `base` is claimed and cleared before it is freed, so a reader that sees both has a range.
struct Holes {
    slots: [Hole; MAX_HOLES],
    /// Slots `[0, used)` may be taken.
    used: AtomicUsize,
    /// Ranges not recorded because every slot was taken.
    overflows: AtomicU64,
    /// `overflows` as last reported ([`report_unrecorded_holes`]).
    reported: AtomicU64,
}

struct Hole {
    base: AtomicUsize,
    len: AtomicUsize,
}

static HOLES: Holes = Holes {
    slots: [const { Hole { base: AtomicUsize::new(0), len: AtomicUsize::new(0) } }; MAX_HOLES],
    used: AtomicUsize::new(0),
    overflows: AtomicU64::new(0),
    reported: AtomicU64::new(0),
};

impl Holes {
    /// Records `[base, base+len)`; `false` (counted in `overflows`) if the table is full.
    fn record(&self, base: usize, len: usize) -> bool {
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.base.load(Ordering::Relaxed) == 0
                && slot.base.compare_exchange(0, base, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                self.used.fetch_max(i + 1, Ordering::AcqRel);
                slot.len.store(len, Ordering::Release);
                return true;
            }
        }
        self.overflows.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Records `[base, base+len)` and marks it `MADV_DONTFORK`; on failure drops the record and
    /// returns the errno.
    fn keep_out(&self, base: usize, len: usize) -> std::result::Result<(), i32> {
        // Recorded before it is advised: a fork in between copies the range (not advised yet),
        // and the child's reservation attempt finds it mapped and leaves it alone.
        // (With the table full, the child gets a hole there, which faults, but no reservation;
        // the overflow is counted and reported by `report_unrecorded_holes`.)
        self.record(base, len);
        // SAFETY: advice on a mapping the caller owns; it does not change the parent's contents.
        if unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_DONTFORK) } != 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL);
            self.forget(base, len);
            return Err(errno);
        }
        Ok(())
    }

    /// The count of ranges not recorded, if it grew since the last call. No allocation.
    fn unreported_overflows(&self) -> Option<u64> {
        let overflows = self.overflows.load(Ordering::Relaxed);
        (overflows > 0 && self.reported.fetch_max(overflows, Ordering::Relaxed) < overflows).then_some(overflows)
    }

    /// Frees the slot of `[base, base+len)`, if one records it.
    fn forget(&self, base: usize, len: usize) {
        let used = self.used.load(Ordering::Acquire);
        for slot in &self.slots[..used] {
            if slot.base.load(Ordering::Acquire) == base
                && slot.len.compare_exchange(len, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                slot.base.store(0, Ordering::Release);
                return;
            }
        }
    }

    fn reserve_all(&self) {
        let used = self.used.load(Ordering::Acquire);
        for slot in &self.slots[..used] {
            let base = slot.base.load(Ordering::Acquire);
            let len = slot.len.load(Ordering::Acquire);
            if base != 0 && len != 0 {
                reserve(base, len);
            }
        }
    }
}

/// Maps `PROT_NONE` over the unmapped parts of `[base, base+len)` (page-aligned), replacing
/// nothing: where the range is partly mapped, each half is tried in turn, down to single pages
/// (a few calls per boundary between mapped and unmapped parts). No allocation.
fn reserve(base: usize, len: usize) {
    let page = page_size();
    // SAFETY: asks for a fresh inaccessible mapping exactly there; MAP_FIXED_NOREPLACE refuses
    // (EEXIST) if anything is mapped in the range, so no mapping is replaced.
    let p = unsafe {
        libc::mmap(
            base as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p as usize == base {
        return;
    }
    if p != libc::MAP_FAILED {
        // A kernel before 4.17 takes the address as a hint only and mapped elsewhere: undo.
        // SAFETY: the mapping we just made, referenced by nothing.
        unsafe { libc::munmap(p, len) };
    } else if std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
        return; // out of memory or mappings: the range stays a hole (which faults)
    }
    // Something is mapped in the range (or the address was only a hint). All of it (msync
    // fails with ENOMEM on any unmapped part; MS_ASYNC does nothing to anonymous memory): done.
    // SAFETY: msync only checks the range here; it changes nothing.
    if len <= page || unsafe { libc::msync(base as *mut libc::c_void, len, libc::MS_ASYNC) } == 0 {
        return;
    }
    // Partly: each half in turn.
    let half = (len / 2).next_multiple_of(page).min(len - page);
    reserve(base, half);
    reserve(base + half, len - half);
}

impl Mapping {
    /// Maps `len` bytes (rounded up to whole pages, at least one page) of zeroed memory, prepared
    /// for `fork()` as registered memory must be ([`advise_fork`]: a child gets a copy where the
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
        if let Err(errno) = advise_fork(p as usize, rounded) {
            // SAFETY: the mapping just made, referenced by nothing.
            unsafe { libc::munmap(p, rounded) };
            return Err(Error::Io {
                what: format!("madvise(MADV_DONTFORK) of a {rounded}-byte registered mapping"),
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
        report_unrecorded_holes();
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
        forget_fork(self.ptr.as_ptr() as usize, self.len);
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

    /// A second table, on the heap (the process's is in use by other tests).
    fn private_holes() -> Box<Holes> {
        let mut b = Box::<Holes>::new_uninit();
        // SAFETY: all-zero bytes are a valid Holes (atomics of 0: every slot free, no overflow).
        unsafe {
            b.as_mut_ptr().write_bytes(0, 1);
            b.assume_init()
        }
    }

    #[test]
    fn the_record_reuses_slots() {
        let holes = private_holes();
        assert!(holes.record(0x1000, 0x2000));
        assert!(holes.record(0x5000, 0x1000));
        assert_eq!(holes.used.load(Ordering::Relaxed), 2);
        holes.forget(0x1000, 0x1000); // not this length: kept
        assert_eq!(holes.slots[0].len.load(Ordering::Relaxed), 0x2000);
        holes.forget(0x1000, 0x2000);
        assert_eq!(holes.slots[0].base.load(Ordering::Relaxed), 0);
        assert!(holes.record(0x9000, 0x1000));
        assert_eq!(holes.slots[0].base.load(Ordering::Relaxed), 0x9000, "the freed slot is reused");
        assert_eq!(holes.used.load(Ordering::Relaxed), 2);
    }

    /// A range that does not fit in the table is counted, and reported once per new overflow.
    #[test]
    fn a_full_record_counts_what_it_could_not_record() {
        let holes = private_holes();
        for slot in &holes.slots {
            slot.base.store(1, Ordering::Relaxed);
        }
        assert_eq!(holes.unreported_overflows(), None);
        assert!(!holes.record(0x1000, 0x1000));
        assert_eq!(holes.overflows.load(Ordering::Relaxed), 1);
        assert_eq!(holes.unreported_overflows(), Some(1));
        assert_eq!(holes.unreported_overflows(), None, "reported once");
        assert!(!holes.record(0x2000, 0x1000));
        assert_eq!(holes.unreported_overflows(), Some(2));
        holes.slots[7].base.store(0, Ordering::Relaxed);
        assert!(holes.record(0x3000, 0x1000), "a freed slot takes the next range");
        assert_eq!(holes.overflows.load(Ordering::Relaxed), 2);
    }

    /// Keeping a range out of children either marks it `MADV_DONTFORK` and records it, or fails
    /// with the errno and records nothing (here: a start that is not page-aligned, `EINVAL`).
    #[test]
    fn a_failed_dontfork_is_an_error_and_leaves_no_record() {
        let holes = private_holes();
        let len = 2 * page_size();
        let m = Mapping::anonymous(len).unwrap();
        let base = m.as_ptr() as usize;
        assert_eq!(holes.keep_out(base + 1, len - 1), Err(libc::EINVAL), "madvise refuses");
        assert_eq!(holes.slots[0].base.load(Ordering::Relaxed), 0, "the record is dropped");
        assert_eq!(holes.slots[0].len.load(Ordering::Relaxed), 0);
        assert_eq!(holes.keep_out(base, len), Ok(()));
        assert!(vm_flags(base).split_whitespace().any(|w| w == "dc"), "advised MADV_DONTFORK");
        assert_eq!(holes.slots[0].base.load(Ordering::Relaxed), base);
        holes.forget(base, len);
    }

    /// The mechanism of kernels that do not copy pinned pages at fork, exercised directly here
    /// (where children get copies, nothing is advised): a range marked `MADV_DONTFORK` is a
    /// hole in a child; recorded, the child's handler reserves it, inaccessible, around whatever
    /// the child has mapped in it meanwhile and replacing nothing.
    #[test]
    fn a_child_reserves_what_was_kept_out_of_it() {
        let page = page_size();
        let map = |len: usize| {
            // SAFETY: a fresh anonymous mapping at a kernel-chosen address.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            // SAFETY: our mapping: writable, len bytes; then advice on it.
            unsafe {
                p.cast::<u8>().write_bytes(0x77, len);
                assert_eq!(libc::madvise(p, len, libc::MADV_DONTFORK), 0);
            }
            p as usize
        };
        // a: recorded; b: not recorded; c: recorded, and the child maps its second page first.
        let (a, b, c) = (map(2 * page), map(2 * page), map(4 * page));
        assert!(HOLES.record(a, 2 * page));
        assert!(HOLES.record(c, 4 * page));
        let mut fds = [0; 2];
        // SAFETY: a fresh pipe.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child makes system calls and atomic reads only (no allocation, no lock),
        // then reports through the pipe and kills itself.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let try_map = |at: usize, prot: i32| {
                // SAFETY: a mapping exactly at `at`, refused if anything is mapped there.
                let p = unsafe {
                    libc::mmap(
                        at as *mut libc::c_void,
                        page,
                        prot,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                        -1,
                        0,
                    )
                };
                p as usize == at
            };
            let code = 'checks: {
                // The child's own page in the middle of c, before the handler's work.
                if !try_map(c + page, libc::PROT_READ | libc::PROT_WRITE) {
                    break 'checks 1;
                }
                // SAFETY: the page just mapped, read-write.
                unsafe { ((c + page) as *mut u8).write(0x5a) };
                HOLES.reserve_all();
                // Recorded: reserved (nothing more can be mapped there), around the child's page.
                if [a, a + page, c, c + 2 * page, c + 3 * page].into_iter().any(|at| try_map(at, libc::PROT_READ)) {
                    break 'checks 2;
                }
                // SAFETY: the child's own page, kept.
                if unsafe { ((c + page) as *const u8).read_volatile() } != 0x5a {
                    break 'checks 3;
                }
                // Not recorded: a plain hole (this is what a child would find without the record).
                if !try_map(b, libc::PROT_READ) {
                    break 'checks 4;
                }
                // The reservation is inaccessible: a read there kills a (grand)child with SIGSEGV.
                // SAFETY: the grandchild only reads and exits.
                let g = unsafe { libc::fork() };
                if g == 0 {
                    // SAFETY: faults (the point of the check); _exit if it does not.
                    unsafe {
                        std::ptr::read_volatile(a as *const u8);
                        libc::_exit(0);
                    }
                }
                let mut status = 0;
                // SAFETY: g is our child.
                if g < 0 || unsafe { libc::waitpid(g, &mut status, 0) } != g {
                    break 'checks 5;
                }
                if !libc::WIFSIGNALED(status) || libc::WTERMSIG(status) != libc::SIGSEGV {
                    break 'checks 6;
                }
                0u8
            };
            // SAFETY: one byte from a local to our pipe; then the child ends at once (no exit
            // processing: a leak check would count the parent's memory as the child's).
            unsafe {
                libc::write(fds[1], [code].as_ptr().cast(), 1);
                libc::kill(libc::getpid(), libc::SIGKILL);
                libc::_exit(i32::from(code));
            }
        }
        let mut status = 0;
        // SAFETY: pid is our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let mut code = [0xffu8];
        // SAFETY: reads one byte of our pipe (the child wrote it before it ended), then closes it.
        let n = unsafe {
            let n = libc::read(fds[0], code.as_mut_ptr().cast(), 1);
            libc::close(fds[0]);
            libc::close(fds[1]);
            n
        };
        for (at, len) in [(a, 2 * page), (b, 2 * page), (c, 4 * page)] {
            // SAFETY: our mappings, referenced by nothing any more.
            unsafe { libc::munmap(at as *mut libc::c_void, len) };
            HOLES.forget(at, len);
        }
        assert_eq!(n, 1, "the child reported nothing (status {status:#x})");
        assert_eq!(code[0], 0, "child check {} failed", code[0]);
    }

    #[test]
    fn absurd_size_is_an_error() {
        assert!(Mapping::anonymous(usize::MAX).is_err());
        assert!(Mapping::anonymous(1 << 60).is_err());
    }
}
