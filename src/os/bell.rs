//! `Bell`: an eventfd that one thread rings to wake another out of `poll(2)`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::error::{Error, Result};

/// An eventfd (non-blocking, close-on-exec) used as a wake-up: [`Bell::ring`] makes it readable,
/// [`Bell::drain`] makes it quiet again; the woken thread polls [`Bell::fd`] for `POLLIN`.
/// Ringing and draining never block and never fail in a way the caller could act on: a full
/// counter (`EAGAIN` on write) is still readable, so the wake-up is pending anyway; nothing to
/// read (`EAGAIN` on read) means it was quiet; `EINTR` is retried.
///
/// `fork()`: a child's copy is a descriptor of the same eventfd (ringing it would wake the
/// parent's poller). Whoever owns a bell decides what its child does with it: dropping it closes
/// only the child's descriptor.
#[derive(Debug)]
pub(crate) struct Bell(OwnedFd);

impl Bell {
    /// A new, quiet bell.
    ///
    /// # Errors
    /// [`Error::Io`] (saying "creating `what`") if the eventfd cannot be created.
    pub(crate) fn new(what: &str) -> Result<Bell> {
        // SAFETY: eventfd has no memory arguments; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Io { what: format!("creating {what}"), source: std::io::Error::last_os_error() });
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        Ok(Bell(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Wakes whoever polls the bell (or will).
    pub(crate) fn ring(&self) {
        let one = 1u64;
        loop {
            // SAFETY: writes 8 bytes from a live u64 to the eventfd this bell owns (non-blocking).
            let n = unsafe { libc::write(self.0.as_raw_fd(), std::ptr::addr_of!(one).cast(), 8) };
            // EAGAIN: the counter is full, so a wake-up is pending already.
            if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return;
            }
        }
    }

    /// Makes the bell quiet again (reads and drops its counter).
    pub(crate) fn drain(&self) {
        let mut n = 0u64;
        loop {
            // SAFETY: reads at most 8 bytes into a live u64 from the eventfd this bell owns
            // (non-blocking).
            let r = unsafe { libc::read(self.0.as_raw_fd(), std::ptr::addr_of_mut!(n).cast(), 8) };
            // EAGAIN: nothing rang.
            if r >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return;
            }
        }
    }

    /// The descriptor to poll for `POLLIN` (valid while the bell lives).
    pub(crate) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::Bell;

    /// Whether the bell's descriptor is readable now.
    fn readable(b: &Bell) -> bool {
        let mut p = libc::pollfd { fd: b.fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n == 1 && p.revents & libc::POLLIN != 0
    }

    #[test]
    fn rings_and_drains() {
        let b = Bell::new("a test bell").unwrap();
        assert!(!readable(&b), "a new bell is quiet");
        b.ring();
        b.ring();
        assert!(readable(&b), "a rung bell wakes its poller");
        b.drain();
        assert!(!readable(&b), "one drain quiets any number of rings");
        b.drain(); // draining a quiet bell neither blocks nor fails
        assert!(!readable(&b));
    }
}
