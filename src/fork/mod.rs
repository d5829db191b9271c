//! `fork()`: telling a parent's objects from a child's, what a child finds of the parent's
//! registered memory, and the crate's process-wide locks that a child must find unlocked.
//!
//! A child has one thread, a copy of the parent's memory and the parent's verbs descriptors.
//! Registered memory (the data chunks of scoped heaps, registered buffers) holds typed values —
//! a `Vec<NonZeroU64, Heap>`, a `Box`, the `String`s of a map — so a child must see either the
//! parent's bytes or nothing, never zero pages posing as values. Which one is decided once per
//! process ([`children_copy_pinned_pages`]):
//! - kernels that copy pinned anonymous pages into the child at fork (Linux 5.13+; rdma-core
//!   reports `IBV_FORK_UNNEEDED`) get no fork advice at all: the child sees copies, and the
//!   parent keeps its pinned pages (no copy-on-write between it and the NIC);
//! - older kernels, or a process where rdma-core's fork support is enabled (`ibv_fork_init`,
//!   `RDMAV_FORK_SAFE`; on any kernel, since rdma-core then marks every registration
//!   `MADV_DONTFORK` itself — before v51.0 it does so even where it reports
//!   `IBV_FORK_UNNEEDED`, so the decision tries rdma-core out rather than trusting that answer),
//!   get `MADV_DONTFORK` (else the parent's first write after a fork would
//!   move its page away from the NIC's), so the child has no mapping there; every such range is
//!   recorded ([`advise_fork`]) and the child's fork handler maps an inaccessible
//!   `PROT_NONE` reservation over it, so that touching it faults and no later mapping of the
//!   child can land where a parent's value was.
//!
//! mralloc never calls `ibv_fork_init`. Where it is enabled anyway, rdma-core marks every
//! registration `MADV_DONTFORK` itself, including memory a child cannot do without: the global
//! allocator's chunks (all of the child's heap; jemalloc's metadata, which its fork handlers
//! touch, is never registered). Those are marked `MADV_DOFORK` again after each registration
//! (`heap::chunk::keep_in_children`), with the copy-on-write caveat that entails (see there).
//!
//! The parent's queue pairs, memory regions and heaps stay the parent's: the child must neither
//! use them (their rings and registered pages are not the child's) nor destroy them (the kernel
//! objects are shared with the parent, which keeps using them). So each object remembers the
//! fork *generation* it was made in: a child's handler bumps the generation, after which the
//! parent's objects refuse every use with [`Error::Forked`] and release nothing when dropped,
//! while objects made in the child work.
//!
//! The crate's process-wide locks are [`ForkLock`]s, which a child finds unlocked even if
//! another parent thread held one at the fork (that thread does not exist in the child).
//! jemalloc's own locks are jemalloc's (its fork handlers); a heap's own locks are only taken by
//! the parent's objects, which the child no longer uses.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::error::{Error, Result};

mod copies;
mod holes;

pub(crate) use copies::{children_copy_pinned_pages, decided_copies};
pub(crate) use holes::{forget_fork, report_unrecorded_holes};

/// Bumped in every forked child (by the handler `install` registers).
static GENERATION: AtomicU32 = AtomicU32::new(0);

/// The fork generation an object was made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Born(u32);

impl Born {
    /// The current generation (installing the fork handler first: an object made now must be
    /// told apart in any later child).
    pub(crate) fn now() -> Born {
        install();
        Born(GENERATION.load(Ordering::Relaxed))
    }

    /// The generation of objects that exist before any fork (the global allocator's).
    #[cfg_attr(not(feature = "global"), allow(dead_code))]
    pub(crate) const FIRST: Born = Born(0);

    /// Whether the object lives in the process that made it (not in a fork()ed child of it).
    #[inline(always)]
    pub(crate) fn here(self) -> bool {
        GENERATION.load(Ordering::Relaxed) == self.0
    }

    /// `Ok` in the process that made the object; [`Error::Forked`] in a child.
    #[inline(always)]
    pub(crate) fn check(self, what: &'static str) -> Result<()> {
        if self.here() {
            Ok(())
        } else {
            Err(Error::Forked(what))
        }
    }
}

/// A fork generation that can be closed: [`Gate::here`] is [`Born::here`] of the generation it
/// was opened with until [`Gate::close`], and `false` in every process after it. It costs what
/// `Born::here` costs (a load and a compare), so a fast path that already leaves for forked
/// children can leave through it for something else as well (a scoped heap's frees, once the
/// heap drains: `heap::shared`); the slow path tells the two apart with the object's `Born`.
pub(crate) struct Gate(AtomicU32);

/// No generation: the generation counts the forks of one lineage of processes (a child adds
/// one, two at most, to its parent's), so it never gets there.
const CLOSED: u32 = u32::MAX;

impl Gate {
    /// Open for objects born in `born`.
    pub(crate) const fn open(born: Born) -> Gate {
        Gate(AtomicU32::new(born.0))
    }

    /// Whether the gate is open and the object lives in the process that made it.
    #[inline(always)]
    pub(crate) fn here(&self) -> bool {
        GENERATION.load(Ordering::Relaxed) == self.0.load(Ordering::Relaxed)
    }

    /// Closes the gate for good.
    pub(crate) fn close(&self) {
        self.0.store(CLOSED, Ordering::Relaxed);
    }
}

/// Registers the child handler (once per process; a child inherits the registration).
/// (Not a `Once`: a fork while another thread runs it would leave the child's copy running for
/// ever. Two threads racing here may both register; the generation then moves by two in a
/// child, which tells parent from child just as well. A caller returns only once a handler is
/// registered.)
pub(crate) fn install() {
    static INSTALLED: AtomicBool = AtomicBool::new(false);
    if INSTALLED.load(Ordering::Acquire) {
        return;
    }
    // SAFETY: registers a handler that runs in the child only; it makes one atomic update (no
    // allocation, no lock).
    let rc = unsafe { libc::pthread_atfork(None, None, Some(child)) };
    if rc != 0 {
        tracing::error!(
            rc,
            "pthread_atfork failed: a fork()ed child may find the parent's objects usable and mralloc's locks held"
        );
    }
    // Only now: whoever sees it set finds the handler registered.
    INSTALLED.store(true, Ordering::Release);
}

/// Prepares `[base, base+len)` (a private anonymous mapping about to hold registered memory)
/// for `fork()`, as this module explains: where the kernel copies pinned pages into a child
/// (Linux 5.13+), nothing — the child gets a copy of the bytes. Otherwise the range is recorded
/// and marked `MADV_DONTFORK`: the child has no mapping there, and its fork handler maps an
/// inaccessible reservation over it (`holes::reserve_fork_holes`). Never `MADV_WIPEONFORK`: zero
/// pages in place of typed values (a `NonZeroU64`, a `Box`, a `String`) are undefined
/// behaviour in the child. Call [`forget_fork`] after unmapping the range.
///
/// # Errors
/// The errno of a failed `madvise(MADV_DONTFORK)` (the record is dropped again): the range
/// would be shared copy-on-write with children, so the caller must not use it as registered
/// memory.
///
/// No allocation and no lock (it runs inside jemalloc's extent hooks) once the process has
/// decided ([`children_copy_pinned_pages`], whose first call may allocate: owners
/// make it in `Owner::new`) and installed its fork handler (every owner has: `Born::now`).
pub(crate) fn advise_fork(base: usize, len: usize) -> std::result::Result<(), i32> {
    if children_copy_pinned_pages() {
        return Ok(());
    }
    // The child's handler must run in every child from now on.
    install();
    holes::keep_out(base, len)
}

/// With the global allocator, the handler is registered when the program is loaded: `Global`
/// makes no object that would register it, and its chunk table's lock must be free in a child.
#[cfg(feature = "global")]
#[used]
#[link_section = ".init_array"]
static INSTALL_AT_LOAD: extern "C" fn() = {
    extern "C" fn install_at_load() {
        install();
    }
    install_at_load
};

extern "C" fn child() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
    // The scoped heaps' fast path finds the last front cache used without a generation check.
    crate::heap::forget_fronts_in_child();
    // Only where the parent's registered memory is not in the child (older kernels): holds
    // its place with inaccessible reservations. No allocation, no lock.
    holes::reserve_fork_holes();
}

/// A process-wide lock for short critical sections (spins, then yields) that a fork()ed child
/// finds unlocked: its word holds the generation of its last holder, and a lock held by a
/// thread of an earlier generation (a parent thread, which the child does not have) counts as
/// free. The data may have been mid-update at the fork: the first holder of a new generation
/// gets [`ForkGuard::after_fork`] `true` and repairs it. It never allocates, so it may be taken
/// inside jemalloc's hooks.
pub(crate) struct ForkLock<T> {
    /// `generation << 1 | held`.
    word: AtomicU32,
    data: UnsafeCell<T>,
}

// SAFETY: the data is only reached through a guard, which the lock hands to one thread at a time.
unsafe impl<T: Send> Sync for ForkLock<T> {}

impl<T> ForkLock<T> {
    pub(crate) const fn new(data: T) -> ForkLock<T> {
        ForkLock { word: AtomicU32::new(0), data: UnsafeCell::new(data) }
    }

    pub(crate) fn lock(&self) -> ForkGuard<'_, T> {
        let gen = GENERATION.load(Ordering::Relaxed);
        let mine = (gen << 1) | 1;
        let mut spins = 0u32;
        loop {
            let w = self.word.load(Ordering::Relaxed);
            let held_here = w & 1 == 1 && w >> 1 == gen;
            if !held_here && self.word.compare_exchange_weak(w, mine, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return ForkGuard { lock: self, after_fork: w >> 1 != gen };
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // SAFETY: plain syscall.
                unsafe { libc::sched_yield() };
            }
        }
    }
}

/// A held [`ForkLock`].
pub(crate) struct ForkGuard<'a, T> {
    lock: &'a ForkLock<T>,
    /// The first holder since a fork: the data may be torn.
    pub(crate) after_fork: bool,
}

impl<T> std::ops::Deref for ForkGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> std::ops::DerefMut for ForkGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock exclusively.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T> Drop for ForkGuard<'_, T> {
    fn drop(&mut self) {
        // Keeps the generation: the next holder in this process sees no fork.
        self.lock.word.fetch_and(!1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_excludes_and_counts() {
        static L: ForkLock<u64> = ForkLock::new(0);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..10_000 {
                        *L.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*L.lock(), 40_000);
    }

    /// A lock another thread holds at the fork is free in the child (that thread is not there),
    /// and the child's first holder is told to repair the data; objects made before the fork
    /// are not the child's.
    #[test]
    fn a_child_finds_locks_free_and_parent_objects_foreign() {
        static L: ForkLock<u64> = ForkLock::new(7);
        let born = Born::now();
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let g = L.lock();
            held_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            drop(g);
        });
        held_rx.recv().unwrap();
        // The child reports through a pipe, then kills itself: no exit processing (a leak check
        // under valgrind would count the parent's memory as the child's leaks).
        let mut fds = [0; 2];
        // SAFETY: a fresh pipe.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only takes the lock, reads atomics, writes to the pipe and kills
        // itself (no allocation, no lock of anything but `L`).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let g = L.lock();
            let code = if !g.after_fork || *g != 7 {
                1
            } else if born.here() || born.check("x").is_ok() {
                2
            } else if !Born::now().here() {
                3
            } else {
                0
            };
            drop(g);
            let again = L.lock();
            let code = if code == 0 && again.after_fork { 4 } else { code };
            // SAFETY: one byte from a local to our pipe; then the child ends at once.
            unsafe {
                libc::write(fds[1], [code as u8].as_ptr().cast(), 1);
                libc::kill(libc::getpid(), libc::SIGKILL);
                libc::_exit(code);
            }
        }
        let mut status = 0;
        let start = std::time::Instant::now();
        loop {
            // SAFETY: pid is our child.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            if start.elapsed() > std::time::Duration::from_secs(20) {
                // SAFETY: our child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("the child hung on a lock its parent's thread held at the fork");
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        let mut code = [0xffu8];
        // SAFETY: reads one byte of our pipe (the child wrote it before it ended), then closes it.
        let n = unsafe {
            let n = libc::read(fds[0], code.as_mut_ptr().cast(), 1);
            libc::close(fds[0]);
            libc::close(fds[1]);
            n
        };
        assert_eq!(n, 1, "the child reported nothing (status {status:#x})");
        assert_eq!(code[0], 0, "child check {} failed", code[0]);
        assert!(born.here(), "the parent is unchanged");
        assert!(!L.lock().after_fork);
    }

    #[test]
    fn born_now_is_here() {
        let b = Born::now();
        assert!(b.here());
        assert!(b.check("x").is_ok());
        assert!(Born::FIRST.here(), "no fork in this process");
    }
}
