//! What tells that a connection's peer is gone, besides the device's events: the TCP stream it
//! was set up over, or its RDMA CM event channel (read by the connection watcher).

use std::os::fd::RawFd;

use rdma_sys as ffi;

use crate::error::Disconnect;
use crate::transfer::setup::cm::raw_event;

/// What tells that a connection's peer is gone, besides the device's events.
pub(crate) enum Source {
    /// The TCP stream the connection was set up over (owned by the connection).
    Tcp(RawFd),
    /// A CM id's own, non-blocking event channel (owned by the connection).
    Cm(*mut ffi::rdma_event_channel),
}

// SAFETY: the channel is only read (rdma_get_cm_event, thread-safe) by the watcher, under its
// lock, while the registration that names it exists; the connection destroys it only after
// dropping the registration.
unsafe impl Send for Source {}

impl Source {
    pub(crate) fn fd(&self) -> RawFd {
        match *self {
            Source::Tcp(fd) => fd,
            // SAFETY: a live channel (see Send).
            Source::Cm(ch) => unsafe { (*ch).fd },
        }
    }

    /// Reads what arrived: whether it shows the connection dead, and whether the source is
    /// still worth watching (a closed socket stays readable; a broken channel would spin).
    pub(crate) fn check(&self) -> (Option<Disconnect>, bool) {
        match *self {
            Source::Tcp(fd) => {
                let mut buf = [0u8; 64];
                // SAFETY: a live socket (see Send); the buffer is ours.
                let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
                match n {
                    0 => (Some(Disconnect::PeerClosed), false),
                    n if n > 0 => (None, true), // Nothing is sent after setup; discarded.
                    _ => {
                        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
                        if errno == libc::EAGAIN || errno == libc::EINTR {
                            (None, true)
                        } else {
                            (Some(Disconnect::PeerReset { errno }), false)
                        }
                    }
                }
            }
            Source::Cm(ch) => {
                let mut found = None;
                loop {
                    // SAFETY: a live, non-blocking channel (see Send).
                    match unsafe { raw_event(ch) } {
                        Ok(Some(kind)) if kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED => {
                            found = found.or(Some(Disconnect::CmDisconnected))
                        }
                        Ok(Some(kind)) if kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                            found = Some(Disconnect::DeviceRemoved)
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => return (found, true),
                        Err(e) => {
                            tracing::warn!(
                                "reading a connection's RDMA CM events failed ({e}); no longer watching them"
                            );
                            return (found, false);
                        }
                    }
                }
            }
        }
    }
}
