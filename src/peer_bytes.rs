//! Bytes a peer may write at any moment (memory whose remote-write key is live): read and written
//! with relaxed atomic byte accesses, never through `&[u8]`/`&mut [u8]`. The one place the
//! exposed types ([`crate::heap::Exposed`], [`crate::verbs::RemoteWritable`]) copy their bytes.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::{Error, Result};

/// `[offset, offset + n)` inside `len` bytes, or why not.
fn checked(offset: usize, n: usize, len: usize) -> Result<usize> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(offset),
        _ => Err(Error::OutOfBounds { offset: offset as u64, len: n as u64, size: len as u64 }),
    }
}

/// Byte `i` of the memory at `base` as an atomic.
///
/// # Safety
/// `base + i` lies in memory that stays valid for `'a` and that nothing accesses meanwhile
/// except atomically or by the NIC.
unsafe fn byte<'a>(base: *mut u8, i: usize) -> &'a AtomicU8 {
    // SAFETY: the caller's contract; AtomicU8 has u8's size and alignment.
    unsafe { AtomicU8::from_ptr(base.add(i)) }
}

/// Copies `out.len()` bytes at `offset` out of the `len` bytes at `base`.
///
/// # Safety
/// `[base, base + len)` is valid memory for the call, accessed meanwhile only atomically or by
/// the NIC (no references to it exist).
///
/// # Errors
/// [`Error::OutOfBounds`] if the range does not fit.
pub(crate) unsafe fn copy_out(base: *mut u8, len: usize, offset: usize, out: &mut [u8]) -> Result<()> {
    let s = checked(offset, out.len(), len)?;
    for (i, o) in out.iter_mut().enumerate() {
        // SAFETY: s + i < len (checked); the caller's contract.
        *o = unsafe { byte(base, s + i) }.load(Ordering::Relaxed);
    }
    Ok(())
}

/// Copies `src` into the `len` bytes at `base`, at `offset`.
///
/// # Safety
/// As [`copy_out`], and the memory is writable.
///
/// # Errors
/// [`Error::OutOfBounds`] if the range does not fit.
pub(crate) unsafe fn copy_in(base: *mut u8, len: usize, offset: usize, src: &[u8]) -> Result<()> {
    let s = checked(offset, src.len(), len)?;
    for (i, &b) in src.iter().enumerate() {
        // SAFETY: s + i < len (checked); the caller's contract.
        unsafe { byte(base, s + i) }.store(b, Ordering::Relaxed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_in_bounds_and_refuses_the_rest() {
        let mut mem = vec![0u8; 16];
        let base = mem.as_mut_ptr();
        // SAFETY: `mem` is live for these calls and nothing else touches it.
        unsafe {
            copy_in(base, 16, 4, b"abcd").unwrap();
            let mut out = [0u8; 6];
            copy_out(base, 16, 3, &mut out).unwrap();
            assert_eq!(&out, b"\0abcd\0");
            assert!(copy_in(base, 16, 14, b"abc").is_err());
            assert!(copy_out(base, 16, usize::MAX, &mut out).is_err());
        }
    }
}
