//! Helpers over jemalloc's `mallctl` for arenas, thread caches and statistics: values go
//! through tikv-jemalloc-ctl; the two shapes it does not cover (a command with no value, and
//! `arenas.create`, which reads an index and writes a hooks pointer) call mallctl directly.

use std::ffi::CString;

use libc::c_void;
use tikv_jemalloc_sys as je;

use crate::error::{Error, Result};

fn name(n: &str) -> Result<CString> {
    CString::new(n).map_err(|_| Error::InvalidArgument(format!("mallctl name {n:?} contains NUL")))
}

fn check(what: &str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Jemalloc { what: what.to_string(), detail: std::io::Error::from_raw_os_error(rc).to_string() })
    }
}

fn nul(n: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(n.len() + 1);
    v.extend_from_slice(n.as_bytes());
    v.push(0);
    v
}

fn ctl_err(what: &str, e: tikv_jemalloc_ctl::Error) -> Error {
    Error::Jemalloc { what: what.to_string(), detail: e.to_string() }
}

/// Reads a value (through tikv-jemalloc-ctl).
pub(crate) fn read<T: Copy>(n: &str) -> Result<T> {
    // SAFETY: every caller names a mallctl whose value has type T.
    unsafe { tikv_jemalloc_ctl::raw::read::<T>(&nul(n)) }.map_err(|e| ctl_err(n, e))
}

/// Whether jemalloc zeroes every allocation (`opt.zero`, a debugging option, e.g.
/// `_RJEM_MALLOC_CONF=zero:true`). Then a data extent aligned to 2 MiB can reach the alloc hook
/// with the arguments of a metadata block (see hooks.rs), which is never registered: heaps and
/// `Global` refuse to start instead. Allocates nothing (a static name: `Global` asks while it
/// installs itself as the process allocator).
pub(crate) fn zeroes_everything() -> bool {
    // SAFETY: `opt.zero` is a bool mallctl; the name is NUL-terminated.
    unsafe { tikv_jemalloc_ctl::raw::read::<bool>(b"opt.zero\0") }.unwrap_or(false)
}

/// Why a heap refuses to start under `opt.zero` ([`zeroes_everything`]).
pub(crate) const ZERO_REFUSED: &str = "jemalloc runs with opt.zero (was _RJEM_MALLOC_CONF or malloc_conf \
     set to zero:true?): mralloc's heaps need it off (they zero what is asked zeroed themselves)";

/// Writes a value (through tikv-jemalloc-ctl).
pub(crate) fn write<T: Copy>(n: &str, v: T) -> Result<()> {
    // SAFETY: every caller names a mallctl whose value has type T.
    unsafe { tikv_jemalloc_ctl::raw::write::<T>(&nul(n), v) }.map_err(|e| ctl_err(n, e))
}

/// `tcache.flush` of explicit tcache `tcache`, allocating nothing (a refused allocation's
/// fallback calls it: the global allocator may serve from the heap that refused). Returns
/// mallctl's error number.
pub(crate) fn tcache_flush(tcache: u32) -> i32 {
    let mut t: libc::c_uint = tcache;
    // SAFETY: `tcache.flush` takes an unsigned int index as its new value, no old value.
    unsafe {
        je::mallctl(
            c"tcache.flush".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            (&mut t as *mut libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>(),
        )
    }
}

/// Runs a command mallctl (no input, no output), e.g. `arena.9.purge`.
pub(crate) fn run(n: &str) -> Result<()> {
    let c = name(n)?;
    // SAFETY: no old or new value.
    let rc = unsafe { je::mallctl(c.as_ptr(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), 0) };
    check(n, rc)
}

/// Creates an arena served by `hooks` (which must outlive it). Returns its index.
pub(crate) fn create_arena(hooks: *mut je::extent_hooks_t) -> Result<u32> {
    let mut ind: libc::c_uint = 0;
    let mut len = std::mem::size_of::<libc::c_uint>();
    let mut h = hooks;
    let c = name("arenas.create")?;
    // SAFETY: oldp is a c_uint; newp is an `extent_hooks_t *` as arenas.create expects.
    let rc = unsafe {
        je::mallctl(
            c.as_ptr(),
            (&mut ind as *mut libc::c_uint).cast(),
            &mut len,
            (&mut h as *mut *mut je::extent_hooks_t).cast::<c_void>(),
            std::mem::size_of::<*mut je::extent_hooks_t>(),
        )
    };
    check("arenas.create", rc).map(|_| ind)
}

/// Creates an explicit thread cache.
pub(crate) fn tcache_create() -> Result<u32> {
    read::<libc::c_uint>("tcache.create")
}

/// Flushes and destroys an explicit thread cache.
pub(crate) fn tcache_destroy(id: u32) -> Result<()> {
    write::<libc::c_uint>("tcache.destroy", id)
}

/// Refreshes the statistics snapshot.
pub(crate) fn refresh_stats() {
    let _ = write::<u64>("epoch", 1);
}

/// Bytes jemalloc counts as allocated in arena `arena` (small + large), after [`refresh_stats`].
pub(crate) fn arena_allocated(arena: u32) -> Option<u64> {
    let small = read::<usize>(&format!("stats.arenas.{arena}.small.allocated")).ok()?;
    let large = read::<usize>(&format!("stats.arenas.{arena}.large.allocated")).ok()?;
    Some((small + large) as u64)
}

/// jemalloc's minimum alignment on x86_64 / aarch64: every size class of at least this size is
/// aligned to it.
pub(crate) const MIN_ALIGN: usize = 16;

/// The `mallocx`/`sdallocx` alignment flag for `layout` (tikv-jemallocator's
/// `layout_to_flags`): none when jemalloc's size class already guarantees the alignment, which
/// needs both `align <= 16` *and* `align <= size` — a size below its alignment (8 bytes aligned
/// to 16) falls in a smaller class whose objects are only aligned to that class.
#[inline]
pub(crate) fn align_flags(layout: std::alloc::Layout) -> libc::c_int {
    flags_for(layout.align(), layout.size())
}

/// [`align_flags`] of an alignment and a size (realloc's new size need not make a `Layout`).
#[inline(always)]
pub(crate) fn flags_for(align: usize, size: usize) -> libc::c_int {
    if align <= MIN_ALIGN && align <= size {
        0
    } else {
        je::MALLOCX_LG_ALIGN(align.trailing_zeros() as usize)
    }
}

#[cfg(test)]
mod tests {
    use std::alloc::Layout;

    use super::*;

    #[test]
    fn alignment_flag_whenever_the_size_class_cannot_guarantee_it() {
        let flag = |size, align| align_flags(Layout::from_size_align(size, align).unwrap());
        assert_eq!(flag(64, 8), 0);
        assert_eq!(flag(16, 16), 0);
        assert_eq!(flag(8, 16), je::MALLOCX_LG_ALIGN(4), "size below alignment");
        assert_eq!(flag(1, 2), je::MALLOCX_LG_ALIGN(1), "size below alignment");
        assert_eq!(flag(4096, 4096), je::MALLOCX_LG_ALIGN(12));
        assert_eq!(flag(100, 1 << 21), je::MALLOCX_LG_ALIGN(21));
    }
}
