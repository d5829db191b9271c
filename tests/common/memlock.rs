//! Making the kernel refuse registrations for real: `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`.
//!
//! `ib_umem_get` (every `ibv_reg_mr`, rxe's included) refuses to pin pages beyond the soft
//! `RLIMIT_MEMLOCK` (`ENOMEM`; `EPERM` with a limit of 0) unless the caller has `CAP_IPC_LOCK`,
//! which the VM's root has. Capabilities are per-thread credentials, and uverbs refuses `write()`
//! commands on a device file opened under other credentials (`ib_safe_file_access`): drop the
//! capability *before* opening the device, on the thread that uses it, and in a child process
//! ([`run_in_child`]) so nothing else runs under it. The limit itself is no credential: it can
//! be lowered and raised again (up to the hard limit) while the device is open.

use super::{finish_child, spawn_test};

/// Drops `CAP_IPC_LOCK` (effective and permitted) from the calling thread's credentials: root
/// ignores `RLIMIT_MEMLOCK` otherwise.
pub fn drop_ipc_lock() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const CAP_IPC_LOCK: u32 = 14;
    let mut hdr = Header { version: 0x2008_0522, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data words, as the ABI requires.
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut hdr as *mut Header, data.as_mut_ptr()), 0);
        data[0].effective &= !(1 << CAP_IPC_LOCK);
        data[0].permitted &= !(1 << CAP_IPC_LOCK);
        assert_eq!(libc::syscall(libc::SYS_capset, &mut hdr as *mut Header, data.as_ptr()), 0);
    }
}

/// The pages this process has pinned (`VmPin`, what `ib_umem_get` checks the limit against), in
/// KiB.
pub fn vm_pinned_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmPin:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The current `RLIMIT_MEMLOCK`.
pub fn memlock() -> libc::rlimit {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) }, 0);
    lim
}

/// Sets `RLIMIT_MEMLOCK`'s soft limit to `bytes` (the hard limit stays), panicking if refused.
pub fn set_memlock_soft(bytes: libc::rlim_t) {
    let lim = libc::rlimit { rlim_cur: bytes, rlim_max: memlock().rlim_max };
    // SAFETY: setrlimit with a valid struct.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) };
    assert_eq!(rc, 0, "setrlimit(RLIMIT_MEMLOCK, {bytes}): {}", std::io::Error::last_os_error());
}

/// Runs #[ignore]d test `name` of this binary in a child process with `marker=1` (and `env`) set,
/// echoes its output prefixed (so its own libtest summary is not counted as a result) and
/// requires it to succeed — an abort or a signal fails it — and to print "`what` child: OK".
pub fn run_in_child(name: &str, marker: &str, env: &[(&str, &str)], what: &str) {
    let mut all = vec![(marker, "1")];
    all.extend_from_slice(env);
    let text = finish_child(spawn_test(name, true, &all), &format!("{what} child"));
    assert!(text.contains(&format!("{what} child: OK")), "child did not run its body");
}
