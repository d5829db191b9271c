//! Registering a descriptor with tokio's reactor, with a typed error where tokio would panic.

use std::os::fd::AsRawFd;

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
