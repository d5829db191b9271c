//! Scoped remote grants: a key for exactly one owned buffer, revocable.

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::engine::completion::{Failure, Ticket};
use crate::transfer::exact::Keyed;
use crate::transfer::request::iobuf::IoBufMut;
use crate::transfer::request::iobuf::Rejected;
use crate::transfer::Connection;
use crate::verbs::{Access, SendOp, WcStatus};

/// Remote access to one buffer, given to the peer of one connection, with an rkey of its own
/// over exactly that buffer's bytes, working through that connection only. The grant owns the
/// buffer:
/// - [`Grant::revoke`] kills the rkey, waits for that, and gives the buffer back;
/// - dropping a grant kills the rkey without waiting on the peer: the buffer is freed once the
///   connection has reaped the invalidation (on a failed connection: once its queue pair is
///   flushed, when the connection is dropped);
/// - forgetting a grant leaks the buffer: the peer may keep access to it while the connection
///   lives, never to memory that was freed or reused.
///
/// The buffer must come from a heap built with [`Access::MW_BIND`]. The grant's rights are the
/// ones asked of [`Connection::grant`] (remote read and/or write), whatever remote rights the
/// heap was built with: the key, not the chunk's registration, carries them.
///
/// The key is a type 2 memory window bound through the connection: the device serves it to
/// this connection's queue pair only — another connection of the same PD that learns or
/// guesses the rkey is refused — and refuses every access outside the buffer, on every device.
/// Where the device checks a window against the window's own range the window lies over the
/// heap chunk's registration; mralloc probes that once per opened device
/// ([`crate::verbs::Context::confines_memory_windows`]: a loopback connection and a few
/// accesses, milliseconds, on the first grant). Where it does not (Soft-RoCE in Linux 6.1 checks
/// only against the region under the window), the window lies over a registration of exactly
/// the buffer with local rights only (`ibv_reg_mr`, deregistered when the grant ends: one more
/// pinned range against `RLIMIT_MEMLOCK` and one of the device's `max_mr` regions while it
/// lives).
pub struct Grant<'c, B: IoBufMut> {
    conn: &'c Connection,
    held: Option<Keyed<B>>,
    remote: RemoteBuf,
}

impl<B: IoBufMut> Grant<'_, B> {
    /// What the peer needs: address, length and the grant's rkey.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Whether the window lies over the heap chunk's region (else over an exact registration).
    #[cfg(test)]
    pub(crate) fn over_chunk(&self) -> bool {
        self.held.as_ref().is_some_and(Keyed::over_chunk)
    }

    /// Kills the rkey (later remote accesses fail with a remote access error), waits for that,
    /// and returns the buffer.
    ///
    /// # Errors
    /// - The window's invalidation cannot be posted (the connection's earlier failure,
    ///   [`Error::Timeout`] for send-queue room, [`Error::Verbs`]) or fails
    ///   ([`Error::Operation`], [`Error::Timeout`], [`Error::Verbs`], [`Error::Io`]): the
    ///   connection is failed and closed (its queue pair serves no remote access any more).
    ///   Once it is flushed, the buffer comes back in `buf` with the error; if the flush does
    ///   not come within the close's wait, `buf` is `None` and the connection keeps the buffer
    ///   until it is dropped. With [`Error::FlushLost`] (`buf` `None`) it is leaked.
    /// - The window's deallocation or an exact registration's removal fails ([`Error::Verbs`],
    ///   `buf` `None`): the buffer is leaked.
    ///
    /// In a fork()ed child (the grant is the parent's): [`Error::Forked`], with the child's
    /// copy of the buffer.
    pub fn revoke(mut self) -> std::result::Result<B, Rejected<B>> {
        let held = self.held.take().expect("a live grant holds its key and buffer");
        revoke(self.conn, held)
    }
}

impl<B: IoBufMut> Drop for Grant<'_, B> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            release(self.conn, held);
        }
    }
}

/// Posts the revocation of `held`'s key on `conn`. If it cannot be posted (a failed
/// connection, no send-queue room within the operation timeout), the connection is failed: a
/// QP in the error state serves no remote access through its windows, so the bytes are
/// unreachable either way.
fn post_revocation<K>(conn: &Connection, held: &Keyed<K>) -> Result<Ticket> {
    // SAFETY: LOCAL_INV touches no local memory.
    let r = unsafe { conn.submit_control(held.revocation()) };
    if let Err(e) = &r {
        conn.fail(Failure::local(e));
    }
    r
}

/// A key whose window may be bound, held until it is taken to be revoked or released: dropped
/// before that (unwinding from a panicking log subscriber, say) it leaks the key and what it
/// keeps instead of releasing them under a window that may still serve the peer.
pub(crate) struct Bound<K>(Option<Keyed<K>>);

impl<K> Bound<K> {
    pub(crate) fn new(held: Keyed<K>) -> Bound<K> {
        Bound(Some(held))
    }

    pub(crate) fn get(&self) -> &Keyed<K> {
        self.0.as_ref().expect("a Bound holds its key until taken")
    }

    /// The key, once: a second take panics.
    pub(crate) fn take(&mut self) -> Keyed<K> {
        self.0.take().expect("a Bound holds its key until taken")
    }
}

impl<K> Drop for Bound<K> {
    fn drop(&mut self) {
        if let Some(k) = self.0.take() {
            std::mem::forget(k);
        }
    }
}

/// A bind that failed: what it kept (as [`bind`] says), and whether the failure is the bind's
/// own — refused when posted on a connection that lived, or completed with an error naming
/// it — rather than its connection's (failed by something else: the bind was flushed, or
/// refused with that failure).
pub(crate) struct BindFailed<K> {
    pub(crate) rejected: Rejected<K>,
    pub(crate) own: bool,
}

/// Whether `error`, a bind's, is a completion of its own that failed — an error status that is
/// no flush and no response timeout, naming `wr_id` when known — rather than its connection's
/// failure reported to it (the bind flushed, or the connection timed out).
pub(crate) fn failed_itself(error: &Error, wr_id: Option<u64>) -> bool {
    matches!(error, Error::Operation { wr_id: w, status, .. }
        if wr_id.is_none_or(|id| *w == id) && !matches!(status, WcStatus::WrFlushErr | WcStatus::RespTimeoutErr))
}

/// Binds `held`'s window through `conn` (posts `bind`, the request [`Keyed::prepare`] made,
/// and waits for it): the key works once this returns `Ok`.
///
/// # Errors
/// A bind's failure, as [`Connection::write`] (it fails the connection), with what `held`
/// kept back (the window is unbound, or its QP in the error state and flushed); with
/// [`Error::FlushLost`] that is leaked.
pub(crate) fn bind<K: Send + 'static>(
    conn: &Connection,
    held: Keyed<K>,
    bind: SendOp,
) -> std::result::Result<Keyed<K>, BindFailed<K>> {
    let mut held = Bound::new(held);
    let lived = conn.error().is_none();
    // SAFETY: binding touches no local memory; the window covers what `held` keeps, which it
    // (or the connection, or a leak) keeps until the window is invalidated or the QP flushed.
    let r = match unsafe { conn.submit_control(bind) } {
        Ok(id) => conn.wait(id).map_err(|e| {
            let own = failed_itself(&e, Some(id.wr_id()));
            (e, own)
        }),
        Err(e) => Err((e, lived)),
    };
    match r {
        Ok(_) => Ok(held.take()),
        // The flush never came: leaked (the guard forgets it).
        Err((error @ Error::FlushLost { .. }, own)) => Err(BindFailed { rejected: Rejected { error, buf: None }, own }),
        // A failed bind leaves the window unbound (or the QP in the error state and flushed):
        // nothing reaches the bytes through it.
        Err((error, own)) => Err(BindFailed { rejected: Rejected { error, buf: held.take().into_buf().ok() }, own }),
    }
}

/// Kills `held`'s key (bound through `conn`), waits for that, and gives back what it kept, as
/// [`Grant::revoke`] says (its errors are this function's).
pub(crate) fn revoke<K: Send + 'static>(conn: &Connection, held: Keyed<K>) -> std::result::Result<K, Rejected<K>> {
    if conn.forked_copy() {
        // A fork()ed child's copy: the key is the parent's (nothing to revoke here, and the
        // connection's locks may have been held at the fork); the child's copy of the bytes is
        // its own.
        return Err(Rejected { error: Error::Forked("this grant"), buf: Some(held.into_forked_copy()) });
    }
    let mut held = Bound::new(held);
    let r = post_revocation(conn, held.get()).and_then(|id| conn.wait(id).map(|_| ()));
    match r {
        Ok(()) => held.take().into_buf().map_err(|error| Rejected { error, buf: None }),
        // The flush never came: leaked (the guard forgets it).
        Err(error @ Error::FlushLost { .. }) => Err(Rejected { error, buf: None }),
        // The connection is failed (by the failure, or by `post_revocation`): once its queue
        // pair is flushed the window serves nobody, and what the key kept comes back.
        // (`close` is Ok only with the QP seen in the error state.)
        Err(error) => match conn.close() {
            Ok(()) => Err(Rejected { error, buf: held.take().into_buf().ok() }),
            Err(_) => {
                conn.core().park_until_closed(Box::new(held.take()));
                Err(Rejected { error, buf: None })
            }
        },
    }
}

/// Kills `held`'s key (bound through `conn`) without waiting: what it keeps is released once
/// the connection has reaped the invalidation (on a failed connection: once its queue pair is
/// flushed, when the connection is dropped).
pub(crate) fn release<K: Send + 'static>(conn: &Connection, held: Keyed<K>) {
    if conn.forked_copy() {
        std::mem::forget(held); // a fork()ed child's copy: the parent's, for good
        return;
    }
    let mut held = Bound::new(held);
    let posted = post_revocation(conn, held.get());
    let held = Box::new(held.take());
    match posted {
        Ok(id) => {
            conn.core().park(id, held);
        }
        Err(Error::FlushLost { .. }) => std::mem::forget(held),
        Err(e) => {
            // Parked first: a log subscriber that panics must not drop it.
            conn.core().park_until_closed(held);
            tracing::debug!("revoking a dropped grant: {e}; its buffer is kept until the queue pair is flushed");
        }
    }
}

impl Connection {
    /// Grants the peer `access` (remote read and/or write) to exactly `buf`, with a fresh rkey
    /// (see [`Grant`] for how the device is kept to exactly those bytes). The heap must have
    /// been built with [`Access::MW_BIND`] in its access rights. The first grant on a device
    /// probes it (milliseconds, once per opened device).
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`]:
    /// - the connection's earlier failure; [`Error::InvalidArgument`] (an empty buffer, rights
    ///   other than remote read/write, or a heap without [`Access::MW_BIND`]);
    ///   [`Error::NotRegistered`] (not memory of a heap bound to this connection's PD:
    ///   registered buffers and mapped files are refused too); [`Error::Verbs`] (allocating the
    ///   window or posting its bind; or the exact registration, e.g. past the memlock limit);
    ///   [`Error::Timeout`] (no send-queue room);
    /// - a window bind's failure, as [`Connection::write`] (it fails the connection).
    ///
    /// With [`Error::FlushLost`] the buffer is leaked.
    pub fn grant<B: IoBufMut>(&self, buf: B, access: Access) -> std::result::Result<Grant<'_, B>, Rejected<B>> {
        let (held, op) = Keyed::prepare(self, buf, access)?;
        let remote = held.remote();
        let held = bind(self, held, op).map_err(|f| f.rejected)?;
        Ok(Grant { conn: self, held: Some(held), remote })
    }
}
