//! The record of registered ranges kept out of fork children (`MADV_DONTFORK`, on kernels that
//! do not copy pinned pages) and the child's inaccessible reservations over them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::copies::decided_copies;
use crate::os::page_size;

/// Records `[base, base+len)` and marks it `MADV_DONTFORK` ([`super::advise_fork`]); on failure
/// drops the record and returns the errno. No allocation, no lock.
pub(super) fn keep_out(base: usize, len: usize) -> std::result::Result<(), i32> {
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

/// Drops the fork record of `[base, base+len)` ([`super::advise_fork`]) once it is unmapped. (A fork
/// between the unmap and this finds the range free and reserves it in the child: harmless, the
/// child owns nothing there.) A range that was never recorded is ignored. No allocation, no lock.
pub(crate) fn forget_fork(base: usize, len: usize) {
    if decided_copies() == Some(false) {
        HOLES.forget(base, len);
    }
}

/// In a fork()ed child, where registered ranges are kept out of children: maps a `PROT_NONE`
/// reservation over every range the parent had marked `MADV_DONTFORK` ([`super::advise_fork`]), so a
/// child touching a parent's value faults, and nothing the child maps later lands there. Never
/// replaces a mapping (`MAP_FIXED_NOREPLACE`): a part that is mapped (a range recorded but not yet
/// advised at the fork) is left as it is. Runs in the fork handler: no allocation, no lock.
pub(crate) fn reserve_fork_holes() {
    if decided_copies() == Some(false) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mmap::tests::vm_flags;
    use crate::mmap::Mapping;

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
}
