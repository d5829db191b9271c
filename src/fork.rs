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
//!   `RDMAV_FORK_SAFE`), get `MADV_DONTFORK` (else the parent's first write after a fork would
//!   move its page away from the NIC's), so the child has no mapping there; every such range is
//!   recorded ([`crate::mmap::advise_fork`]) and the child's fork handler maps an inaccessible
//!   `PROT_NONE` reservation over it, so that touching it faults and no later mapping of the
//!   child can land where a parent's value was.
//!
//! mralloc never calls `ibv_fork_init`. Where it is enabled anyway, rdma-core marks every
//! registration `MADV_DONTFORK` itself, including memory a child cannot do without: jemalloc's
//! metadata (its fork handlers touch it) and the global allocator's chunks (all of the child's
//! heap). Those are marked `MADV_DOFORK` again after each registration
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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};

use libc::c_uint;

use crate::error::{Error, Result};

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
    // Only where the parent's registered memory is not in the child (older kernels): holds
    // its place with inaccessible reservations. No allocation, no lock.
    crate::mmap::reserve_fork_holes();
}

/// [`children_copy_pinned_pages`], once decided: 0 = not yet, 1 = copies, 2 = no copies.
static COPIES: AtomicU8 = AtomicU8::new(0);

// rdma-core's `enum ibv_fork_status` (`infiniband/verbs.h`, rdma-core v35+: `IBV_FORK_DISABLED`,
// `IBV_FORK_ENABLED`, `IBV_FORK_UNNEEDED`, in that order), defined here because older headers,
// which rdma-sys binds as it finds them, have neither the enum nor the function.
/// `IBV_FORK_DISABLED`: `ibv_fork_init` was not called (and rdma-core saw no copy-on-fork).
const IBV_FORK_DISABLED: c_uint = 0;
/// `IBV_FORK_ENABLED`: `ibv_fork_init` was called; rdma-core marks registrations `MADV_DONTFORK`.
const IBV_FORK_ENABLED: c_uint = 1;
/// `IBV_FORK_UNNEEDED`: the kernel copies pinned pages into fork children.
const IBV_FORK_UNNEEDED: c_uint = 2;

/// `enum ibv_fork_status ibv_is_fork_initialized(void)` (a C enum of these values is an
/// `unsigned int`, as rdma-sys binds it).
type IsForkInitialized = unsafe extern "C" fn() -> c_uint;

/// `ibv_is_fork_initialized`, looked up at run time in the libraries the process has loaded:
/// it exists from rdma-core v35 on (symbol version `IBVERBS_1.13`); `None` with an older
/// libibverbs, which then cannot tell whether the kernel copies pinned pages.
fn lookup_is_fork_initialized() -> Option<IsForkInitialized> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only searches the loaded
    // objects' symbol tables.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"ibv_is_fork_initialized".as_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: a non-null address of the function of that name, which libibverbs defines as
    // `enum ibv_fork_status ibv_is_fork_initialized(void)`: the type above.
    Some(unsafe { std::mem::transmute::<*mut libc::c_void, IsForkInitialized>(p) })
}

/// What the environment tells about rdma-core's fork support: a variable set to anything counts
/// (rdma-core reads the fork-safety ones with a bare `getenv`; for `RDMAV_USE_MADVISE` this errs
/// towards no copies, which is always safe).
#[derive(Debug, Clone, Copy, Default)]
struct ForkEnv {
    /// `RDMAV_FORK_SAFE` or `IBV_FORK_SAFE`: rdma-core calls `ibv_fork_init` when it
    /// initialises (the first `ibv_get_device_list`), which may come after this decision (a
    /// heap can be made before any device is opened).
    fork_safe: bool,
    /// `RDMAV_USE_MADVISE`: `ibv_fork_init` enables `MADV_DONTFORK` of registrations even where
    /// the kernel copies pinned pages.
    use_madvise: bool,
}

impl ForkEnv {
    /// Reads the environment (allocates).
    fn read() -> ForkEnv {
        let set = |name: &str| std::env::var_os(name).is_some();
        ForkEnv { fork_safe: set("RDMAV_FORK_SAFE") || set("IBV_FORK_SAFE"), use_madvise: set("RDMAV_USE_MADVISE") }
    }
}

/// The decision of [`children_copy_pinned_pages`] from its inputs: rdma-core's function if
/// `lookup` finds it, the environment, and the kernel's rule (asked only when needed).
fn decide(
    lookup: impl FnOnce() -> Option<IsForkInitialized>,
    env: ForkEnv,
    kernel_copies: impl FnOnce() -> bool,
) -> bool {
    // SAFETY: rdma-core's query takes no arguments and only reads its fork state (its first
    // call may query the kernel over RDMA netlink); it never initialises fork support.
    let status = lookup().map(|f| unsafe { f() });
    match status {
        // Copies, unless rdma-core is told to madvise registrations anyway.
        Some(IBV_FORK_UNNEEDED) => !(env.fork_safe && env.use_madvise),
        // rdma-core marks every registration MADV_DONTFORK.
        Some(IBV_FORK_ENABLED) => false,
        // IBV_FORK_DISABLED (or an unknown value), or an rdma-core without the query (before
        // v35): rdma-core will madvise registrations if the environment asks it to; otherwise
        // the kernel decides.
        Some(IBV_FORK_DISABLED) | Some(_) | None => !env.fork_safe && kernel_copies(),
    }
}

/// Whether a fork()ed child gets copies of the parent's pinned (registered) anonymous pages
/// (and rdma-core leaves registrations without fork advice), decided on the first call and
/// fixed for the process (a child inherits the answer).
///
/// Asks rdma-core's `ibv_is_fork_initialized` if the loaded libibverbs has it (rdma-core v35+;
/// looked up at run time; it needs no device and does not initialise fork support):
/// `IBV_FORK_UNNEEDED` means the kernel copies pinned pages at fork; `IBV_FORK_ENABLED` means
/// `ibv_fork_init` was called (by someone, or by rdma-core itself for `RDMAV_FORK_SAFE` /
/// `IBV_FORK_SAFE`), so rdma-core marks every registration `MADV_DONTFORK` itself: no copies.
/// rdma-core learns the kernel's answer over RDMA netlink, which needs the `ib_core` module:
/// without it (a host with no RDMA device), or with an rdma-core older than v35, the kernel's
/// version decides (copy-on-fork of pinned anonymous pages: Linux 5.13) — unless
/// `RDMAV_FORK_SAFE` or `IBV_FORK_SAFE` is set, which makes rdma-core enable fork support when
/// it initialises, perhaps after this call (then: no copies). A later explicit `ibv_fork_init`
/// by other code is not seen.
///
/// The first call may allocate and take locks (the environment, `dlsym`, rdma-core's netlink
/// query through libnl), so it must be made outside jemalloc's hooks: `Owner::new` makes it
/// for every scoped heap (before its arena exists), `Owner::bind` before taking any lock (for
/// the global allocator, whose owner is a constant), and `Mapping::anonymous` for registered
/// buffers. Later calls read one atomic. Racing first calls all return the first stored answer.
pub(crate) fn children_copy_pinned_pages() -> bool {
    if let Some(copies) = decided_copies() {
        return copies;
    }
    let copies = decide(lookup_is_fork_initialized, ForkEnv::read(), || kernel_at_least(5, 13));
    match COPIES.compare_exchange(0, if copies { 1 } else { 2 }, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => copies,
        Err(first) => first == 1,
    }
}

/// The decision of [`children_copy_pinned_pages`] if it was made: `Some(false)` only where
/// registered ranges are not copied into children. For the fork handler and the extent hooks,
/// which must not decide anything. No allocation, no lock.
pub(crate) fn decided_copies() -> Option<bool> {
    match COPIES.load(Ordering::Acquire) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

/// Whether the running kernel's release (`uname -r`) is at least `major.minor` (`false` if it
/// cannot be read). No allocation.
fn kernel_at_least(major: u32, minor: u32) -> bool {
    // SAFETY: utsname is plain bytes; all-zero is a valid value.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uname fills the struct we own.
    if unsafe { libc::uname(&mut u) } != 0 {
        return false;
    }
    parse_release(u.release.iter().map(|c| c.to_ne_bytes()[0])).is_some_and(|v| v >= (major, minor))
}

/// `(major, minor)` of a kernel release such as `6.1.0-56-amd64` (bytes up to a NUL).
fn parse_release(bytes: impl Iterator<Item = u8>) -> Option<(u32, u32)> {
    let mut parts = [0u32; 2];
    let mut at = 0;
    let mut digits = 0;
    for b in bytes {
        match b {
            b'0'..=b'9' => {
                parts[at] = parts[at].saturating_mul(10).saturating_add(u32::from(b - b'0'));
                digits += 1;
            }
            b'.' if at == 0 && digits > 0 => {
                at = 1;
                digits = 0;
            }
            _ => break,
        }
    }
    (at == 1 && digits > 0).then_some((parts[0], parts[1]))
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
    fn kernel_releases_parse() {
        let p = |s: &str| parse_release(s.bytes().chain([0, b'9']));
        assert_eq!(p("6.1.0-56-amd64"), Some((6, 1)));
        assert_eq!(p("5.13"), Some((5, 13)));
        assert_eq!(p("4.19.0+"), Some((4, 19)));
        assert_eq!(p("6.18.44-fc-v657"), Some((6, 18)));
        assert_eq!(p("6"), None);
        assert_eq!(p(""), None);
        assert_eq!(p(".5"), None);
        assert!(kernel_at_least(2, 6));
        assert!(!kernel_at_least(999, 0));
    }

    /// The process's decision equals rdma-core's answer and the kernel's release, each found
    /// independently of the code under test: rdma-core's query through a `dlopen` handle of
    /// libibverbs (not `RTLD_DEFAULT`), the release from `/proc/sys/kernel/osrelease` (not
    /// `uname`), the rule written out again.
    #[test]
    fn the_decision_follows_rdma_core_and_the_kernel() {
        let copies = children_copy_pinned_pages();
        assert_eq!(decided_copies(), Some(copies));
        assert_eq!(children_copy_pinned_pages(), copies, "fixed once decided");

        // SAFETY: only finds the libibverbs this test binary already loaded (RTLD_NOLOAD).
        let lib = unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        assert!(!lib.is_null(), "the test binary links libibverbs");
        // SAFETY: a symbol lookup in that handle.
        let f = unsafe { libc::dlsym(lib, c"ibv_is_fork_initialized".as_ptr()) };
        let status = (!f.is_null()).then(|| {
            // SAFETY: libibverbs' `enum ibv_fork_status ibv_is_fork_initialized(void)`; it
            // takes no arguments and changes nothing.
            unsafe { std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn() -> u32>(f)() }
        });
        // SAFETY: the handle dlopen returned (dropping its reference; the library stays).
        unsafe { libc::dlclose(lib) };

        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut numbers = release.trim().split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().unwrap());
        let (major, minor) = (numbers.next().unwrap(), numbers.next().unwrap());
        let set = |name| std::env::var_os(name).is_some();
        let fork_safe = set("RDMAV_FORK_SAFE") || set("IBV_FORK_SAFE");
        let expected = match status {
            Some(2) => !(fork_safe && set("RDMAV_USE_MADVISE")),
            Some(1) => false,
            _ => !fork_safe && (major, minor) >= (5, 13),
        };
        assert_eq!(
            lookup_is_fork_initialized().is_some(),
            status.is_some(),
            "the run-time lookup finds what dlopen does"
        );
        println!("rdma-core: {status:?}, kernel {major}.{minor}, fork-safe environment: {fork_safe}");
        assert_eq!(copies, expected, "rdma-core {status:?}, kernel {major}.{minor}");
        if !fork_safe {
            assert_ne!(status, Some(1), "nothing in these tests calls ibv_fork_init");
        }
    }

    /// rdma-core's answer for `decide`, injected.
    unsafe extern "C" fn says_disabled() -> c_uint {
        IBV_FORK_DISABLED
    }
    unsafe extern "C" fn says_enabled() -> c_uint {
        IBV_FORK_ENABLED
    }
    unsafe extern "C" fn says_unneeded() -> c_uint {
        IBV_FORK_UNNEEDED
    }

    /// Without `ibv_is_fork_initialized` (rdma-core before v35: the lookup finds nothing) the
    /// kernel's rule decides; with it, rdma-core's answer does, the kernel being asked only for
    /// `IBV_FORK_DISABLED`; the fork-safety environment means no copies unless rdma-core already
    /// knows the kernel copies.
    #[test]
    fn the_decision_falls_back_to_the_kernel_without_rdma_cores_query() {
        let env = ForkEnv::default();
        let asked = std::cell::Cell::new(0);
        let kernel = |copies: bool| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                copies
            }
        };
        assert!(decide(|| None, env, kernel(true)));
        assert!(!decide(|| None, env, kernel(false)));
        assert_eq!(asked.get(), 2, "absent: the kernel's rule decides");

        asked.set(0);
        assert!(decide(|| Some(says_disabled as IsForkInitialized), env, kernel(true)));
        assert!(!decide(|| Some(says_disabled as IsForkInitialized), env, kernel(false)));
        assert_eq!(asked.get(), 2);
        assert!(decide(|| Some(says_unneeded as IsForkInitialized), env, kernel(false)));
        assert!(!decide(|| Some(says_enabled as IsForkInitialized), env, kernel(true)));
        assert_eq!(asked.get(), 2, "rdma-core's ENABLED and UNNEEDED need no kernel rule");

        let fork_safe = ForkEnv { fork_safe: true, use_madvise: false };
        assert!(!decide(|| None, fork_safe, kernel(true)), "rdma-core will madvise once it initialises");
        assert!(!decide(|| Some(says_disabled as IsForkInitialized), fork_safe, kernel(true)));
        assert!(decide(|| Some(says_unneeded as IsForkInitialized), fork_safe, kernel(true)));
        let madvise = ForkEnv { fork_safe: true, use_madvise: true };
        assert!(!decide(|| Some(says_unneeded as IsForkInitialized), madvise, kernel(true)));
    }

    #[test]
    fn born_now_is_here() {
        let b = Born::now();
        assert!(b.here());
        assert!(b.check("x").is_ok());
        assert!(Born::FIRST.here(), "no fork in this process");
    }
}
