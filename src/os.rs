//! The few operating-system facts the crate asks for in more than one place.

/// The size of a memory page (4096 if the system cannot say).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}
