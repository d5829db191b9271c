//! The few operating-system facts and primitives the crate asks for in more than one place.

mod bell;

pub(crate) use bell::Bell;

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

/// Fills `buf` from the kernel's CSPRNG (`getrandom(2)`, again after EINTR or a short read).
///
/// # Errors
/// [`crate::Error::Io`] naming `what` the bytes are for.
pub(crate) fn fill_random(buf: &mut [u8], what: &str) -> crate::error::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let tail = &mut buf[filled..];
        // SAFETY: the pointer and length describe `tail`, a live, writable part of `buf`.
        let got = unsafe { libc::getrandom(tail.as_mut_ptr().cast(), tail.len(), 0) };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(crate::Error::Io { what: format!("reading random bytes for {what} (getrandom)"), source: e });
        }
        filled += got as usize;
    }
    Ok(())
}

/// Writes one line to stderr without allocating (at most 512 bytes): for messages from inside
/// the allocator, where formatting into a `String` could re-enter it.
#[cfg(feature = "global")]
pub(crate) fn stderr_line(args: std::fmt::Arguments<'_>) {
    struct Buf([u8; 512], usize);
    impl std::fmt::Write for Buf {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let n = s.len().min(self.0.len() - self.1);
            self.0[self.1..self.1 + n].copy_from_slice(&s.as_bytes()[..n]);
            self.1 += n;
            Ok(())
        }
    }
    let mut b = Buf([0; 512], 0);
    let _ = std::fmt::Write::write_fmt(&mut b, args);
    let _ = std::fmt::Write::write_str(&mut b, "\n");
    // SAFETY: writes b.1 initialised bytes to fd 2.
    unsafe { libc::write(2, b.0.as_ptr().cast(), b.1) };
}
