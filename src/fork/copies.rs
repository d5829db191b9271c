//! Whether a fork()ed child gets copies of the parent's registered (pinned) pages: decided once
//! per process, from rdma-core's answer, the environment and the kernel's version.

use std::sync::atomic::{AtomicU8, Ordering};

use libc::c_uint;

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
}
