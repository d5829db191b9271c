//! Thin helpers over jemalloc's `mallctl` for arenas, thread caches and statistics.

use std::ffi::CString;

use libc::c_void;
use tikv_jemalloc_sys as je;

use crate::error::{Error, Result};

fn name(n: &str) -> CString {
    CString::new(n).expect("mallctl names contain no NUL")
}

fn check(what: &str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Jemalloc { what: what.to_string(), errno: rc })
    }
}

/// Reads a value.
pub(crate) fn read<T: Copy + Default>(n: &str) -> Result<T> {
    let mut v = T::default();
    let mut len = std::mem::size_of::<T>();
    let c = name(n);
    // SAFETY: oldp points at a T of oldlen bytes; jemalloc checks the length matches.
    let rc = unsafe { je::mallctl(c.as_ptr(), (&mut v as *mut T).cast(), &mut len, std::ptr::null_mut(), 0) };
    check(n, rc).map(|_| v)
}

/// Writes a value.
pub(crate) fn write<T: Copy>(n: &str, v: T) -> Result<()> {
    let mut v = v;
    let c = name(n);
    // SAFETY: newp points at a T of newlen bytes; jemalloc checks the length matches.
    let rc = unsafe {
        je::mallctl(
            c.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            (&mut v as *mut T).cast(),
            std::mem::size_of::<T>(),
        )
    };
    check(n, rc)
}

/// Runs a command mallctl (no input, no output), e.g. `arena.9.purge`.
pub(crate) fn run(n: &str) -> Result<()> {
    let c = name(n);
    // SAFETY: no old or new value.
    let rc = unsafe { je::mallctl(c.as_ptr(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), 0) };
    check(n, rc)
}

/// Creates an arena served by `hooks` (which must outlive it). Returns its index.
pub(crate) fn create_arena(hooks: *mut je::extent_hooks_t) -> Result<u32> {
    let mut ind: libc::c_uint = 0;
    let mut len = std::mem::size_of::<libc::c_uint>();
    let mut h = hooks;
    let c = name("arenas.create");
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
