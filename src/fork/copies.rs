//! Whether a fork()ed child gets copies of the parent's registered (pinned) pages: decided once
//! per process, from the kernel's behaviour (rdma-core's answer, else the kernel's version) and
//! from what rdma-core's fork support does to registrations, which is tried out on a scratch page.

use std::sync::atomic::{AtomicU8, Ordering};

use libc::{c_int, c_uint, c_void};
use rdma_sys as ffi;

use crate::os::page_size;

/// [`children_copy_pinned_pages`], once decided: 0 = not yet, 1 = copies, 2 = no copies.
static COPIES: AtomicU8 = AtomicU8::new(0);

// rdma-core's `enum ibv_fork_status` (`infiniband/verbs.h`, rdma-core v35+: `IBV_FORK_DISABLED`,
// `IBV_FORK_ENABLED`, `IBV_FORK_UNNEEDED`, in that order), defined here because older headers,
// which rdma-sys binds as it finds them, have neither the enum nor the function.
/// `IBV_FORK_DISABLED`: `ibv_fork_init` was not called (and rdma-core saw no copy-on-fork).
const IBV_FORK_DISABLED: c_uint = 0;
/// `IBV_FORK_ENABLED`: `ibv_fork_init` was called; rdma-core marks registrations `MADV_DONTFORK`.
const IBV_FORK_ENABLED: c_uint = 1;
/// `IBV_FORK_UNNEEDED`: the kernel copies pinned pages into fork children. Says nothing about
/// rdma-core's own fork support, which it takes precedence over: rdma-core before v51.0 (before
/// linux-rdma/rdma-core#1431; v44, Debian 12's, measured in the VM) enables that support for
/// `RDMAV_FORK_SAFE` (or an explicit `ibv_fork_init`) all the same, and then marks every
/// registration `MADV_DONTFORK` while answering `IBV_FORK_UNNEEDED`; v51.0 and later skip it
/// where the kernel copies.
const IBV_FORK_UNNEEDED: c_uint = 2;

/// `enum ibv_fork_status ibv_is_fork_initialized(void)` (a C enum of these values is an
/// `unsigned int`, as rdma-sys binds it).
type IsForkInitialized = unsafe extern "C" fn() -> c_uint;

/// `int ibv_dontfork_range(void *base, size_t size)` and `ibv_dofork_range` (libibverbs, symbol
/// version `IBVERBS_1.1`, which providers call; not in the public headers): what `ibv_reg_mr`
/// and `ibv_dereg_mr` do to a registration's pages, counted per page range.
type ForkRange = unsafe extern "C" fn(*mut c_void, usize) -> c_int;

/// The function `name` in the libraries the process has loaded, if one defines it.
///
/// # Safety
/// `F` must be the function pointer type of the C function of that name.
unsafe fn lookup<F: Copy>(name: &std::ffi::CStr) -> Option<F> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only searches the loaded
    // objects' symbol tables.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: a non-null address of the function of that name, whose type the caller names.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// `ibv_is_fork_initialized`, looked up at run time: it exists from rdma-core v35 on (symbol
/// version `IBVERBS_1.13`); `None` with an older libibverbs, which then cannot tell whether the
/// kernel copies pinned pages.
fn lookup_is_fork_initialized() -> Option<IsForkInitialized> {
    // SAFETY: libibverbs defines it as `enum ibv_fork_status ibv_is_fork_initialized(void)`.
    unsafe { lookup::<IsForkInitialized>(c"ibv_is_fork_initialized") }
}

/// What the environment tells about rdma-core's fork support: a variable set to anything but
/// `0` counts (rdma-core's `check_env` rule since v40; earlier releases took any value, `0`
/// included, which only makes this answer err towards no copies there).
#[derive(Debug, Clone, Copy, Default)]
struct ForkEnv {
    /// `RDMAV_FORK_SAFE` or `IBV_FORK_SAFE`: rdma-core calls `ibv_fork_init` when it
    /// initialises (the first `ibv_get_device_list`), which may come after this decision (a
    /// heap can be made before any device is opened).
    fork_safe: bool,
}

impl ForkEnv {
    /// Reads the environment (allocates).
    fn read() -> ForkEnv {
        let set = |name: &str| std::env::var_os(name).is_some_and(|v| v != "0");
        ForkEnv { fork_safe: set("RDMAV_FORK_SAFE") || set("IBV_FORK_SAFE") }
    }
}

/// Whether rdma-core's fork support is on, i.e. whether it marks every registration
/// `MADV_DONTFORK` (`None`: it could not be told). Tried on a scratch page: rdma-core's
/// `ibv_dontfork_range`, which `ibv_reg_mr` calls, either marks it (the page becomes a mapping
/// of its own in `/proc/self/maps`) or, with fork support off, only notes that it is too late
/// to turn it on — so the answer holds for the rest of the process: a later `ibv_fork_init`
/// fails with `EINVAL` (rdma-core releases that skip fork support where the kernel copies return
/// 0 and leave it off), as it does after the process's first registration anyway.
///
/// Under `RDMAV_FORK_SAFE` / `IBV_FORK_SAFE` rdma-core is initialised first (a device list,
/// freed at once), so that it has turned its fork support on, if it does, before the try.
/// Allocates; outside jemalloc's hooks only.
fn rdma_core_marks_registrations(env: ForkEnv) -> Option<bool> {
    // SAFETY: libibverbs defines both as `int f(void *base, size_t size)`.
    let (dontfork, dofork) =
        unsafe { (lookup::<ForkRange>(c"ibv_dontfork_range")?, lookup::<ForkRange>(c"ibv_dofork_range")?) };
    if env.fork_safe {
        let mut n = 0;
        // SAFETY: lists the devices (initialising rdma-core once); the list is freed at once.
        unsafe {
            let list = ffi::ibv_get_device_list(&mut n);
            if !list.is_null() {
                ffi::ibv_free_device_list(list);
            }
        }
    }
    let page = page_size();
    // SAFETY: a fresh private anonymous mapping of two pages at a kernel-chosen address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // The second page: a mapping of its own once advised (the first one keeps its flags).
    let probe = p as usize + page;
    // SAFETY: our mapping's second page, whole; rdma-core counts it in its tree of ranges.
    let marked = match unsafe { dontfork(probe as *mut c_void, page) } {
        // A non-zero return means rdma-core tried to madvise, so its fork support is on (its
        // rollback after a failed madvise can leave its range counts off; rare, and the answer,
        // no copies, makes mralloc advise its own chunks itself).
        rc if rc != 0 => Some(true),
        _ => {
            let split = mapping_starts_at(probe);
            // SAFETY: balances the call above (rdma-core's count back to 0: MADV_DOFORK).
            unsafe { dofork(probe as *mut c_void, page) };
            split
        }
    };
    // SAFETY: our mapping, referenced by nothing.
    unsafe { libc::munmap(p, 2 * page) };
    marked
}

/// Whether the mapping containing `addr` starts there, per `/proc/self/maps` (`None`: no such
/// mapping, or the file cannot be read). Allocates.
fn mapping_starts_at(addr: usize) -> Option<bool> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let (range, _) = line.split_once(' ')?;
        let (lo, hi) = range.split_once('-')?;
        let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
        (lo..hi).contains(&addr).then_some(lo == addr)
    })
}

/// The decision of [`children_copy_pinned_pages`] from its inputs: rdma-core's function if
/// `lookup` finds it, the environment, the kernel's rule and rdma-core's fork support as tried
/// out (each asked only when needed).
fn decide(
    lookup: impl FnOnce() -> Option<IsForkInitialized>,
    env: ForkEnv,
    kernel_copies: impl FnOnce() -> bool,
    rdma_core_marks: impl FnOnce(ForkEnv) -> Option<bool>,
) -> bool {
    // SAFETY: rdma-core's query takes no arguments and only reads its fork state (its first
    // call may query the kernel over RDMA netlink); it never initialises fork support.
    let status = lookup().map(|f| unsafe { f() });
    let kernel_copies = match status {
        Some(IBV_FORK_UNNEEDED) => true,
        // rdma-core's fork support is on (and it knows of no copy-on-fork).
        Some(IBV_FORK_ENABLED) => return false,
        // IBV_FORK_DISABLED (or an unknown value), or an rdma-core without the query (before
        // v35): the kernel's rule (rdma-core learns copy-on-fork over netlink, which needs
        // ib_core loaded).
        Some(IBV_FORK_DISABLED) | Some(_) | None => kernel_copies(),
    };
    // Even where the kernel copies, rdma-core's fork support, if on, marks every registration
    // MADV_DONTFORK (see IBV_FORK_UNNEEDED): then children get no copies. If that cannot be
    // tried out (no /proc, libibverbs not visible to dlsym), it is taken as on: no copies, the
    // safe direction (children get holes where they would have had copies; an explicit
    // `ibv_fork_init` by other code, with no environment variable, would otherwise crash them).
    kernel_copies && !rdma_core_marks(env).unwrap_or(true)
}

/// Whether a fork()ed child gets copies of the parent's pinned (registered) anonymous pages
/// (and rdma-core leaves registrations without fork advice), decided on the first call and
/// fixed for the process (a child inherits the answer).
///
/// Copies need both:
/// - a kernel that copies pinned pages at fork (Linux 5.13+): rdma-core's
///   `ibv_is_fork_initialized` says so (`IBV_FORK_UNNEEDED`) if the loaded libibverbs has it
///   (rdma-core v35+; looked up at run time; it needs no device and does not initialise fork
///   support) and can ask the kernel over RDMA netlink (which needs the `ib_core` module);
///   otherwise the kernel's version decides. `IBV_FORK_ENABLED` (rdma-core's fork support on,
///   no copy-on-fork known) means no copies;
/// - rdma-core's fork support off (`ibv_fork_init`, called by someone or by rdma-core itself
///   for `RDMAV_FORK_SAFE` / `IBV_FORK_SAFE`): when on, rdma-core marks every registration
///   `MADV_DONTFORK` whatever the kernel does, and before v51.0 it answers `IBV_FORK_UNNEEDED`
///   all the same. So it is tried out ([`rdma_core_marks_registrations`], which also makes it
///   too late to turn on afterwards: the answer cannot go stale); if it cannot be, it is taken
///   as on (no copies).
///
/// The first call may allocate and take locks (the environment, `dlsym`, rdma-core's netlink
/// query through libnl, its initialisation under `RDMAV_FORK_SAFE`, `/proc/self/maps`), so it
/// must be made outside jemalloc's hooks: `Owner::new` makes it for every scoped heap (before
/// its arena exists), `Owner::bind` before taking any lock (for the global allocator, whose
/// owner is a constant), and `Mapping::anonymous` for registered buffers. Later calls read one
/// atomic. Racing first calls all return the first stored answer.
pub(crate) fn children_copy_pinned_pages() -> bool {
    if let Some(copies) = decided_copies() {
        return copies;
    }
    let copies =
        decide(lookup_is_fork_initialized, ForkEnv::read(), || kernel_at_least(5, 13), rdma_core_marks_registrations);
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Whether rdma-core marks a fresh page `MADV_DONTFORK` (`dc` in /proc/self/smaps) when
    /// asked as `ibv_reg_mr` asks it — through a `dlopen` handle of libibverbs, not the code under
    /// test; the page is released again.
    fn rdma_core_marks_a_page() -> bool {
        // SAFETY: only finds the libibverbs this test binary already loaded (RTLD_NOLOAD).
        let lib = unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        assert!(!lib.is_null(), "the test binary links libibverbs");
        let range = |name: &std::ffi::CStr| {
            // SAFETY: a symbol lookup in that handle.
            let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
            assert!(!f.is_null(), "libibverbs has {name:?}");
            // SAFETY: libibverbs' `int f(void *base, size_t size)`.
            unsafe { std::mem::transmute::<*mut c_void, ForkRange>(f) }
        };
        let (dontfork, dofork) = (range(c"ibv_dontfork_range"), range(c"ibv_dofork_range"));
        let page = page_size();
        // SAFETY: a fresh private anonymous page (not a `Mapping`, which gets mralloc's advice).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: our page, whole; balanced by `dofork` below.
        assert_eq!(unsafe { dontfork(p, page) }, 0);
        let marked = crate::mmap::tests::vm_flags(p as usize).split_whitespace().any(|w| w == "dc");
        // SAFETY: as above; then the page, referenced by nothing, is unmapped.
        unsafe {
            dofork(p, page);
            libc::munmap(p, page);
        }
        // SAFETY: the handle dlopen returned (dropping its reference; the library stays).
        unsafe { libc::dlclose(lib) };
        marked
    }

    /// The process's decision equals rdma-core's answer, the kernel's release and what rdma-core
    /// does to a registered page, each found independently of the code under test: rdma-core's
    /// query through a `dlopen` handle of libibverbs (not `RTLD_DEFAULT`), the release from
    /// `/proc/sys/kernel/osrelease` (not `uname`), the page's flags in `/proc/self/smaps` (not
    /// `/proc/self/maps`), the rule written out again.
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
        let marks = rdma_core_marks_a_page();

        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut numbers = release.trim().split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().unwrap());
        let (major, minor) = (numbers.next().unwrap(), numbers.next().unwrap());
        let set = |name| std::env::var_os(name).is_some();
        let fork_safe = set("RDMAV_FORK_SAFE") || set("IBV_FORK_SAFE");
        let expected = match status {
            Some(1) => false,
            Some(2) => !marks,
            _ => (major, minor) >= (5, 13) && !marks,
        };
        assert_eq!(
            lookup_is_fork_initialized().is_some(),
            status.is_some(),
            "the run-time lookup finds what dlopen does"
        );
        println!(
            "rdma-core: {status:?}, marks registrations MADV_DONTFORK: {marks}, kernel {major}.{minor}, fork-safe environment: {fork_safe}: copies {copies}"
        );
        assert_eq!(copies, expected, "rdma-core {status:?}, marking {marks}, kernel {major}.{minor}");
        if !fork_safe {
            assert!(!marks && status != Some(1), "nothing in these tests calls ibv_fork_init");
        }
    }

    /// rdma-core's fork support as the decision tries it out (a scratch page's own mapping in
    /// /proc/self/maps) agrees with the page's flags in /proc/self/smaps, in this process (where
    /// it is off unless the environment turns it on) and in a run of this test and the
    /// decision's with `RDMAV_FORK_SAFE=1` (on, with any rdma-core older than 2024 or on a kernel
    /// that does not copy pinned pages: the decision is then "no copies").
    #[test]
    fn rdma_cores_fork_support_is_seen_as_it_is() {
        let env = ForkEnv::read();
        let seen = rdma_core_marks_registrations(env);
        let marks = rdma_core_marks_a_page();
        println!("fork-safe environment: {}; tried out: {seen:?}; a page's flags: marked {marks}", env.fork_safe);
        assert_eq!(seen, Some(marks));
        if env.fork_safe {
            assert!(!marks || !children_copy_pinned_pages(), "rdma-core marks registrations: no copies");
            println!("fork-safe run: OK");
            return;
        }
        const TESTS: [&str; 2] = [
            "fork::copies::tests::rdma_cores_fork_support_is_seen_as_it_is",
            "fork::copies::tests::the_decision_follows_rdma_core_and_the_kernel",
        ];
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "--nocapture", "--test-threads=1"])
            .args(TESTS)
            .env("RDMAV_FORK_SAFE", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        for line in text.lines() {
            println!("  RDMAV_FORK_SAFE=1 run| {line}");
        }
        assert!(out.status.success(), "the RDMAV_FORK_SAFE=1 run failed");
        assert!(text.contains("fork-safe run: OK") && text.contains("2 passed"), "both tests ran there");
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
    /// kernel's rule decides whether the kernel copies; with it, rdma-core's answer does, the
    /// kernel being asked only for `IBV_FORK_DISABLED`. Where the kernel copies, rdma-core's
    /// fork support is tried out, and marking registrations means no copies — also under
    /// `IBV_FORK_UNNEEDED`, which rdma-core before v51.0 answers with its fork support on (the
    /// case that crashed children in jemalloc's fork handler); where it cannot be tried, no
    /// copies.
    #[test]
    fn the_decision_needs_a_copying_kernel_and_rdma_cores_fork_support_off() {
        let env = ForkEnv::default();
        let fork_safe = ForkEnv { fork_safe: true };
        let asked = std::cell::Cell::new(0);
        let tried = std::cell::Cell::new(0);
        let kernel = |copies: bool| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                copies
            }
        };
        let marks = |answer: Option<bool>| {
            let tried = &tried;
            move |_: ForkEnv| {
                tried.set(tried.get() + 1);
                answer
            }
        };
        let disabled = || Some(says_disabled as IsForkInitialized);
        let enabled = || Some(says_enabled as IsForkInitialized);
        let unneeded = || Some(says_unneeded as IsForkInitialized);

        assert!(decide(|| None, env, kernel(true), marks(Some(false))));
        assert!(!decide(|| None, env, kernel(false), marks(Some(false))));
        assert_eq!((asked.get(), tried.get()), (2, 1), "absent: the kernel's rule, then a try if it copies");

        asked.set(0);
        tried.set(0);
        assert!(decide(disabled, env, kernel(true), marks(Some(false))));
        assert!(!decide(disabled, env, kernel(false), marks(Some(false))));
        assert!(decide(unneeded, env, kernel(false), marks(Some(false))));
        assert!(!decide(enabled, env, kernel(true), marks(Some(false))));
        assert_eq!(asked.get(), 2, "rdma-core's ENABLED and UNNEEDED need no kernel rule");
        assert_eq!(tried.get(), 2, "nothing to try where the kernel does not copy or fork support is on");

        // rdma-core's fork support on where the kernel copies (rdma-core 44 under
        // RDMAV_FORK_SAFE answers UNNEEDED): no copies.
        assert!(!decide(unneeded, fork_safe, kernel(true), marks(Some(true))));
        assert!(!decide(unneeded, env, kernel(true), marks(Some(true))), "an explicit ibv_fork_init");
        assert!(!decide(disabled, fork_safe, kernel(true), marks(Some(true))));
        assert!(!decide(|| None, env, kernel(true), marks(Some(true))));
        // Off (a newer rdma-core ignores RDMAV_FORK_SAFE where the kernel copies): copies.
        assert!(decide(unneeded, fork_safe, kernel(true), marks(Some(false))));
        // Not to be tried (no /proc, libibverbs not visible to dlsym): taken as on, no copies,
        // with or without the environment (an explicit ibv_fork_init sets none).
        assert!(!decide(unneeded, fork_safe, kernel(true), marks(None)));
        assert!(!decide(|| None, fork_safe, kernel(true), marks(None)));
        assert!(!decide(unneeded, env, kernel(true), marks(None)));
    }
}
