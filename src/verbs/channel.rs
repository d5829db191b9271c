//! Completion channels: block on a file descriptor until a CQ has a completion.

use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::Context;

struct ChanInner {
    ch: *mut ffi::ibv_comp_channel,
    _ctx: Context,
}

// SAFETY: a completion channel is a file descriptor plus kernel state; verbs on it are
// thread-safe; destroyed only in Drop, after every CQ using it (they hold a clone).
unsafe impl Send for ChanInner {}
// SAFETY: as above.
unsafe impl Sync for ChanInner {}

impl Drop for ChanInner {
    fn drop(&mut self) {
        if !self._ctx.owned_here() {
            return; // the parent's (a fork()ed child's copy)
        }
        // SAFETY: created by ibv_create_comp_channel; no CQ uses it any more.
        unsafe { ffi::ibv_destroy_comp_channel(self.ch) };
    }
}

/// A completion channel (`ibv_comp_channel`). CQs created with it ([`crate::verbs::Cq::with_channel`])
/// raise an event on it when armed ([`crate::verbs::Cq::arm`]) and a completion arrives.
#[derive(Clone)]
pub struct CompChannel {
    inner: Arc<ChanInner>,
}

impl std::fmt::Debug for CompChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompChannel").field("fd", &self.fd()).finish()
    }
}

impl CompChannel {
    /// Creates a channel on `ctx`.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if `ibv_create_comp_channel` fails.
    /// - [`Error::DeviceRemoved`] once the device was found removed
    ///   ([`Context::is_removed`](crate::verbs::Context::is_removed)).
    pub fn new(ctx: &Context) -> Result<CompChannel> {
        ctx.usable_for_new()?;
        // SAFETY: ctx is live.
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) };
        if ch.is_null() {
            return Err(Error::verbs("ibv_create_comp_channel", 0));
        }
        Ok(CompChannel { inner: Arc::new(ChanInner { ch, _ctx: ctx.clone() }) })
    }

    /// The file descriptor (readable when an event is pending), e.g. for an event loop.
    pub fn fd(&self) -> i32 {
        // SAFETY: the channel is live.
        unsafe { (*self.inner.ch).fd }
    }

    /// The raw channel, valid while this value lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.ch
    }

    /// Makes the channel's descriptor non-blocking, for an event loop: then
    /// [`CompChannel::try_event`] never sleeps.
    ///
    /// # Errors
    /// [`Error::Io`] if `fcntl` fails.
    pub fn set_nonblocking(&self) -> Result<()> {
        let fd = self.fd();
        // SAFETY: fcntl on a descriptor this channel owns; F_GETFL/F_SETFL touch only its flags.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            return Err(Error::Io {
                what: "making a completion channel non-blocking".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Consumes and acknowledges one pending event, if there is one, without sleeping (the
    /// descriptor must be non-blocking: [`CompChannel::set_nonblocking`]). Returns whether one
    /// was there.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_get_cq_event` fails for another reason than "no event" or an
    /// interruption (both return `Ok(false)`).
    pub fn try_event(&self) -> Result<bool> {
        self.inner._ctx.usable()?;
        let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: the channel is live and its descriptor non-blocking (the caller's contract; a
        // blocking one would only make this wait); out-pointers are valid.
        if unsafe { ffi::ibv_get_cq_event(self.inner.ch, &mut cq, &mut ctx) } != 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(false),
                _ => Err(Error::verbs_errno("ibv_get_cq_event", e.raw_os_error().unwrap_or(libc::EIO))),
            };
        }
        // SAFETY: cq is one of the live CQs on this channel (they outlive their events' handling).
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }

    /// Sleeps until an event arrives or `timeout` passes; consumes and acknowledges the event.
    /// Returns whether one arrived. Re-arm the CQ before the next wait.
    ///
    /// # Errors
    /// - [`Error::Io`] if `poll` fails.
    /// - [`Error::Verbs`] if `ibv_get_cq_event` fails.
    ///
    /// An interrupted `poll`, and an event that another reader of a non-blocking descriptor
    /// took first, return `Ok(false)`, not an error.
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        self.inner._ctx.usable()?;
        let mut pfd = libc::pollfd { fd: self.fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(Error::Io { what: "polling a completion channel".into(), source: e });
        }
        if rc == 0 {
            return Ok(false);
        }
        let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: the fd is readable, so this does not block; out-pointers are valid.
        if unsafe { ffi::ibv_get_cq_event(self.inner.ch, &mut cq, &mut ctx) } != 0 {
            let e = std::io::Error::last_os_error();
            // Another reader (an async driver sharing a non-blocking channel) took the event.
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) {
                return Ok(false);
            }
            return Err(Error::verbs_errno("ibv_get_cq_event", e.raw_os_error().unwrap_or(libc::EIO)));
        }
        // SAFETY: cq is one of the live CQs on this channel (they outlive their events' handling).
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}
