//! Scoped remote grants: a type 2 memory window over exactly one owned buffer, revocable.

use crate::error::{Error, Result};
use crate::heap::mr_of;
use crate::remote::RemoteBuf;
use crate::transfer::completion::{Failure, Ticket};
use crate::transfer::iobuf::IoBufMut;
use crate::transfer::pending::Rejected;
use crate::transfer::Connection;
use crate::verbs::{Access, Mw, Pd, SendFlags, SendOp, Sge};

/// Remote access to one buffer through one connection, with an rkey of its own (a type 2
/// memory window bound to just that buffer). The grant owns the buffer:
/// - [`Grant::revoke`] invalidates the rkey, waits for that, and gives the buffer back;
/// - dropping a grant posts the invalidation and returns at once: the connection keeps the
///   buffer until the invalidation completes, then frees it (on a failed connection, until the
///   queue pair is destroyed);
/// - forgetting a grant leaks the buffer: the peer may keep access to it, never to memory that
///   was freed or reused.
///
/// The buffer must come from a heap built with [`Access::MW_BIND`]. The grant's rights are the
/// ones asked of [`Connection::grant`] (remote read and/or write), whatever remote rights the
/// heap was built with: the window, not the chunk's registration, carries them.
///
/// Range checking is the device's: hardware checks every access against the window's own
/// range, but Soft-RoCE (rxe, Linux 6.1) checks only against the region the window is bound
/// to — a whole heap chunk — so there a peer holding the window's rkey can reach the rest of
/// that chunk until the grant is revoked. Where that matters on rxe, expose the buffer with
/// [`crate::heap::Buffer::expose`] (a registration of its own, confined everywhere) instead.
pub struct Grant<'c, B: IoBufMut> {
    conn: &'c Connection,
    mw: Option<Mw>,
    remote: RemoteBuf,
    buf: Option<B>,
}

/// What a dropped grant leaves with the connection: the window and the buffer it covers, only
/// to be dropped — the window first (field order), then the buffer.
struct Held<B> {
    _mw: Mw,
    _buf: B,
}

impl<B: IoBufMut> Grant<'_, B> {
    /// What the peer needs: address, length and the window's rkey.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Posts the invalidation. If it cannot be posted (a failed connection, no send-queue room
    /// within the operation timeout), the connection is failed: a QP in the error state serves
    /// no remote access through its windows, so the buffer is unreachable either way.
    fn post_invalidate(&self) -> Result<Ticket> {
        // SAFETY: LOCAL_INV touches no local memory.
        let r = unsafe {
            self.conn.post_chain(&[Sge::new(0, 0, 0)], &[SendOp::LocalInvalidate(self.remote.rkey)], SendFlags::NONE)
        };
        if let Err(e) = &r {
            self.conn.fail(Failure::local(e));
        }
        r
    }

    /// Invalidates the rkey (later remote accesses fail with a remote access error), waits for
    /// the invalidation, and returns the buffer.
    ///
    /// # Errors
    /// Without the buffer (`buf` is `None`) but in a fork()ed child: if the invalidation
    /// cannot be posted (the connection's earlier failure, [`Error::Timeout`] for send-queue
    /// room, [`Error::Verbs`]) or fails ([`Error::Operation`], [`Error::Timeout`],
    /// [`Error::Verbs`], [`Error::Io`]), the connection is failed (its queue pair serves no
    /// remote access any more) and keeps the buffer until the queue pair is destroyed. With
    /// [`Error::FlushLost`] it is leaked.
    ///
    /// In a fork()ed child (the grant is the parent's): [`Error::Forked`], with the child's
    /// copy of the buffer.
    pub fn revoke(mut self) -> std::result::Result<B, Rejected<B>> {
        let mw = self.mw.take().expect("a live grant holds its window");
        let buf = self.buf.take().expect("a live grant holds its buffer");
        if self.conn.forked_copy() {
            // A fork()ed child's copy: the window is the parent's (nothing to invalidate here,
            // and the connection's locks may have been held at the fork); the child's copy of
            // the bytes is its own. Dropping the window in a child destroys nothing.
            drop(mw);
            return Err(Rejected { error: Error::Forked("this grant"), buf: Some(buf) });
        }
        let r = self.post_invalidate().and_then(|id| self.conn.wait(id).map(|_| ()));
        match r {
            Ok(()) => {
                drop(mw);
                Ok(buf)
            }
            Err(error @ Error::FlushLost { .. }) => {
                std::mem::forget(Held { _mw: mw, _buf: buf });
                Err(Rejected { error, buf: None })
            }
            Err(error) => {
                self.conn.core().park_until_destroyed(Box::new(Held { _mw: mw, _buf: buf }));
                Err(Rejected { error, buf: None })
            }
        }
    }
}

impl<B: IoBufMut> Drop for Grant<'_, B> {
    fn drop(&mut self) {
        let (Some(mw), Some(buf)) = (self.mw.take(), self.buf.take()) else { return };
        let held = Box::new(Held { _mw: mw, _buf: buf });
        if self.conn.forked_copy() {
            std::mem::forget(held); // a fork()ed child's copy: the parent's, for good
            return;
        }
        match self.post_invalidate() {
            Ok(id) => {
                self.conn.core().park(id, held);
            }
            Err(Error::FlushLost { .. }) => std::mem::forget(held),
            Err(e) => {
                tracing::debug!("revoking a dropped grant: {e}; its buffer is kept until the queue pair is destroyed");
                self.conn.core().park_until_destroyed(held);
            }
        }
    }
}

/// Whether `access` is what a window grants: remote read and/or write, nothing else.
pub(crate) fn window_rights(access: Access) -> bool {
    let read_write = Access::REMOTE_READ | Access::REMOTE_WRITE;
    access.bits() & !read_write.bits() == 0 && access.is_remote()
}

/// A fresh window in `pd` and the request that binds it over `ptr..ptr + len` (heap memory
/// registered in `pd`) with `access`, and the rkey it binds with. Nothing is posted.
///
/// # Errors
/// [`Error::InvalidArgument`] (rights other than remote read/write), [`Error::NotRegistered`],
/// [`Error::Verbs`] (allocating the window).
pub(crate) fn window_for(pd: &Pd, ptr: *const u8, len: usize, access: Access) -> Result<(Mw, SendOp, u32)> {
    let (mr, _) = mr_of(ptr, pd).ok_or(Error::NotRegistered { addr: ptr as u64 })?;
    if !window_rights(access) {
        return Err(Error::InvalidArgument("a grant gives remote read and/or write rights only".into()));
    }
    let mw = Mw::new(pd)?;
    let rkey = mw.next_rkey();
    let op = SendOp::BindMw { mw: mw.as_raw(), rkey, mr, addr: ptr as u64, len: len as u64, access: access.bits() };
    Ok((mw, op, rkey))
}

impl Connection {
    /// Grants the peer `access` (remote read and/or write) to exactly `buf`, through this
    /// connection only, with a fresh rkey. The heap must have been built with
    /// [`Access::MW_BIND`] in its access rights.
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`]:
    /// - the connection's earlier failure; [`Error::InvalidArgument`] (an empty buffer, or
    ///   rights other than remote read/write); [`Error::NotRegistered`] (not memory of a heap
    ///   bound to this connection's PD: registered buffers and mapped files are refused too);
    ///   [`Error::Verbs`] (allocating the window, or posting the bind); [`Error::Timeout`] (no
    ///   send-queue room);
    /// - the bind's failure, as [`Connection::write_at`]: e.g. [`Error::Operation`] with
    ///   `MW_BIND_ERR` if the heap lacks [`Access::MW_BIND`] — which fails the connection.
    ///
    /// With [`Error::FlushLost`] the buffer is leaked.
    pub fn grant<B: IoBufMut>(&self, buf: B, access: Access) -> std::result::Result<Grant<'_, B>, Rejected<B>> {
        let (ptr, len) = (buf.stable_ptr(), buf.bytes_len());
        let prepared = self.check().and_then(|()| {
            if len == 0 {
                return Err(Error::InvalidArgument("a grant of zero bytes".into()));
            }
            window_for(self.pd(), ptr, len, access)
        });
        let (mw, op, rkey) = match prepared {
            Ok(x) => x,
            Err(error) => return Err(Rejected { error, buf: Some(buf) }),
        };
        // SAFETY: binding touches no local memory; the window covers `buf`, which the grant (or
        // the connection, or a leak) keeps until the window is invalidated or the QP destroyed.
        let r = unsafe { self.post_chain(&[Sge::new(0, 0, 0)], &[op], SendFlags::NONE) }.and_then(|id| self.wait(id));
        match r {
            Ok(_) => Ok(Grant {
                conn: self,
                mw: Some(mw),
                remote: RemoteBuf { addr: ptr as u64, len: len as u64, rkey },
                buf: Some(buf),
            }),
            Err(error @ Error::FlushLost { .. }) => {
                std::mem::forget(Held { _mw: mw, _buf: buf });
                Err(Rejected { error, buf: None })
            }
            // A failed bind leaves the window unbound (or the QP in the error state and
            // flushed): nothing reaches the buffer through it.
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }
}
