//! Registering a descriptor with tokio's reactor, with a typed error where tokio would panic.

use std::os::fd::{AsRawFd, FromRawFd};

use tokio::io::unix::AsyncFd;
use tokio::runtime::Handle;

use crate::error::{Error, Result};

/// Registers `inner`'s descriptor for readability with the reactor of `handle`'s runtime.
/// `what` names the registration in the error.
///
/// # Safety
/// `inner` owns the descriptor it reports: it stays open, and is the same descriptor, as long
/// as `inner` lives (the returned `AsyncFd` holds it).
///
/// # Errors
/// [`Error::Io`] if the runtime has no I/O driver or the descriptor cannot be registered.
pub(crate) unsafe fn register_readable<T: AsRawFd>(handle: &Handle, inner: T, what: &str) -> Result<AsyncFd<T>> {
    let no_io = |why: String| Error::Io { what: what.into(), source: std::io::Error::other(why) };
    let _guard = handle.enter();
    // tokio panics (rather than failing) on a runtime built without I/O: keep that typed.
    let registered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the caller's contract: `inner` owns its descriptor for as long as it lives,
        // and the AsyncFd owns `inner`.
        unsafe { AsyncFd::register_with_interest(inner, tokio::io::Interest::READABLE) }.map_err(|e| e.to_string())
    }));
    match registered {
        Ok(Ok(fd)) => Ok(fd),
        Ok(Err(e)) => Err(no_io(e)),
        Err(_) => Err(no_io("the runtime has no I/O driver".into())),
    }
}

/// Whether the current tokio runtime has timers (`enable_time`): tokio panics on a timer
/// without them.
pub(crate) fn has_timers() -> bool {
    std::panic::catch_unwind(|| drop(tokio::time::sleep(std::time::Duration::ZERO))).is_ok()
}

/// Checks that there is a current tokio runtime with I/O and timers (the TCP setup exchange
/// needs both; tokio would panic, or a task would hang, without them).
///
/// # Errors
/// [`Error::Io`] (naming `what`) if there is no current runtime, or it lacks timers
/// (`enable_time`) or I/O (`enable_io`).
pub(crate) fn require_io_and_timers(what: &str) -> Result<()> {
    let missing = |why: &str| Error::Io { what: what.into(), source: std::io::Error::other(why.to_string()) };
    let handle = Handle::try_current().map_err(|_| missing("not inside a tokio runtime"))?;
    if !has_timers() {
        return Err(missing("the tokio runtime has no timers (Builder::enable_time)"));
    }
    // SAFETY: eventfd has no memory arguments; the result is checked before use.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Io { what: what.into(), source: std::io::Error::last_os_error() });
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let probe = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: the OwnedFd owns its descriptor for as long as it lives, inside the AsyncFd.
    unsafe { register_readable(&handle, probe, what) }
        .map(drop)
        .map_err(|_| missing("the tokio runtime has no I/O driver (Builder::enable_io)"))
}
