//! Remote memory on an [`AsyncConnection`]: ask the peer for memory of its heap, give it back,
//! hand it over with its contents, push this side's memory to the peer.

use std::future::Future;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::heap::{Buffer, Heap};
use crate::transfer::front::aio::control::ControlShared;
use crate::transfer::front::aio::lending::{
    access_bits, check_lending_heap, lend, Kept, RemoteLimits, RemoteMemory, RemoteMemoryStats,
};
use crate::transfer::front::aio::wire::Msg;
use crate::transfer::front::aio::AsyncConnection;
use crate::transfer::Rejected;
use crate::verbs::Access;

impl AsyncConnection {
    fn control(&self) -> Result<&Arc<ControlShared>> {
        self.shared.control.as_ref().ok_or(Error::NoControlChannel)
    }

    /// The error a request gets once the peer is gone: the data connection's failure.
    fn gone(&self) -> Error {
        self.error().unwrap_or(Error::Closed)
    }

    /// Lends the peer memory of `heap` when it asks ([`AsyncConnection::request_remote`]),
    /// within `limits` (buffers handed over and not yet taken with
    /// [`AsyncConnection::handed_over`] count too). Each grant is a zeroed buffer of exactly
    /// the size asked for, with a key for exactly those bytes that works through this
    /// connection only: the device refuses every access outside them, on every device (a
    /// memory window bound through this connection, over the heap chunk where the device
    /// confines windows to their range, else over a registration of just the buffer: see
    /// [`crate::transfer::Grant`] for the probe that decides and the costs); it is freed when
    /// the peer drops its handle, when the connection closes or fails, or when the peer is found
    /// dead (a keepalive on the control channel). Calling it again replaces the heap and limits for
    /// later requests. Until it is called, requests are refused
    /// ([`crate::RemoteRefusal::NotServing`]); a server that lends from the peer's first
    /// message on sets it on its listener
    /// ([`crate::transfer::AsyncListener::serve_remote_memory`]).
    ///
    /// The rights a peer may ask for are those of this connection's
    /// [`crate::transfer::QpOptions::remote_access`] (remote read and/or write).
    ///
    /// # Errors
    /// [`Error::NoControlChannel`] if the peer is not an async connection;
    /// [`Error::InvalidArgument`] if `heap` was not built with [`Access::MW_BIND`] or is not
    /// bound to this connection's PD; as [`Heap::alloc`] if the one-byte allocation that
    /// checks the binding fails.
    pub fn serve_remote_memory(&self, heap: &Heap, limits: RemoteLimits) -> Result<()> {
        let cs = self.control()?;
        check_lending_heap(heap, self.pd())?;
        cs.lending().lock().set_serving(Some((heap.clone(), limits)));
        Ok(())
    }

    /// Asks the peer for `len` bytes of its heap with `access` (remote read and/or write). The
    /// memory is zeroed, exactly `len` bytes, reachable through this connection only, and freed
    /// at the peer when the returned handle is dropped. Cancelling the future is safe: a grant
    /// that arrives afterwards is given back at once.
    ///
    /// # Errors
    /// [`Error::RemoteRefused`] with the peer's reason and limit; [`Error::NoControlChannel`]
    /// if the peer is not an async connection; [`Error::InvalidArgument`] for 0 bytes or rights
    /// other than remote read/write; the connection's failure (or [`Error::Closed`]) if the
    /// peer is gone.
    pub fn request_remote(
        &self,
        len: u64,
        access: Access,
    ) -> impl Future<Output = Result<RemoteMemory>> + Send + 'static {
        let this = self.clone();
        let started = self.control().and_then(|cs| {
            if let Some(e) = self.error() {
                return Err(e);
            }
            Ok((cs.clone(), cs.request(len, access)?))
        });
        async move {
            let (_cs, rx) = started?;
            match rx.await {
                Ok(Ok(mem)) => Ok(mem),
                Ok(Err((reason, limit))) => Err(Error::RemoteRefused { requested: len, reason, limit }),
                Err(_) => Err(this.gone()),
            }
        }
    }

    /// Gives remote memory back to the peer *with its contents*: instead of freeing it, the
    /// peer revokes the rkey and receives the buffer from
    /// [`AsyncConnection::handed_over`], with `tag` (e.g. a key naming what was written).
    /// Operations on the memory must have completed first (awaited writes have).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `mem` belongs to another connection (it is dropped, so
    /// released as usual); [`Error::NoControlChannel`]; [`Error::Closed`] if the control
    /// channel is gone (the peer frees the memory on its own).
    pub fn hand_over(&self, mem: RemoteMemory, tag: u64) -> Result<()> {
        let cs = self.control()?;
        let (handle, out) = mem.detach();
        match out {
            Some(out) if cs.sends_with(&out) => cs.tell(Msg::HandOver { handle, tag }),
            Some(out) => {
                let _ = out.send(Msg::Release { handle });
                Err(Error::InvalidArgument("the remote memory belongs to another connection".into()))
            }
            None => Err(Error::InvalidArgument("the remote memory was already given up".into())),
        }
    }

    /// The next buffer the peer handed over ([`AsyncConnection::hand_over`]): its tag and the
    /// buffer, whose rkey was revoked before it was returned here.
    ///
    /// # Errors
    /// [`Error::NoControlChannel`]; the connection's failure (or [`Error::Closed`]) once the
    /// peer is gone.
    pub async fn handed_over(&self) -> Result<(u64, Buffer)> {
        let cs = self.control()?;
        let (tag, buf) = cs.next_handed().await.ok_or_else(|| self.gone())?;
        cs.lending().lock().handed(buf.len() as u64, false);
        Ok((tag, buf))
    }

    /// Pushes `buf` to the peer: makes a key for exactly its bytes with `access` (remote read
    /// and/or write; a window bound through this connection, as [`crate::transfer::Grant`]'s)
    /// and sends the grant with `tag`; the peer gets a [`RemoteMemory`] from
    /// [`AsyncConnection::pushed`]. This side keeps the buffer until the peer drops the handle
    /// (then it is freed), hands it back ([`AsyncConnection::handed_over`]), or the connection
    /// goes. The buffer must come from a heap built with [`Access::MW_BIND`].
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`]:
    /// - [`Error::NoControlChannel`]; [`Error::InvalidArgument`] (rights other than remote
    ///   read/write, or beyond this connection's
    ///   [`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access));
    ///   [`Error::NotRegistered`] (not memory of a heap bound to this connection's PD), or a
    ///   heap without [`Access::MW_BIND`] ([`Error::InvalidArgument`]); [`Error::Verbs`]
    ///   (allocating the window, or the exact registration); the connection's failure (or
    ///   [`Error::Closed`]) if it failed or the peer is gone;
    /// - a window bind's failure, as [`AsyncConnection::write`] (it fails the connection).
    ///
    /// `buf` is `None` if the connection's failure path took the buffer meanwhile (it is freed
    /// after the flush), or with [`Error::FlushLost`] (kept until the connection is dropped).
    pub async fn push(&self, buf: Buffer, access: Access, tag: u64) -> std::result::Result<(), Rejected<Buffer>> {
        let checked = self.control().and_then(|cs| {
            let bits = access_bits(access)
                .ok_or_else(|| Error::InvalidArgument("a push grants remote read and/or write rights".into()))?;
            if cs.is_dead() {
                return Err(self.gone());
            }
            if !self.options().qp.remote_access.contains(access) {
                return Err(Error::InvalidArgument(
                    "a push grants rights this connection's QpOptions::remote_access does not allow".into(),
                ));
            }
            Ok((cs.clone(), bits))
        });
        let (cs, bits) = match checked {
            Ok(x) => x,
            Err(error) => return Err(Rejected { error, buf: Some(buf) }),
        };
        let (handle, remote) = lend(cs.lending(), &self.shared, Kept::Own(buf), access)
            .await
            .map_err(|r| Rejected { error: r.error, buf: r.buf.and_then(Kept::into_own) })?;
        cs.announce(handle);
        // If the channel is gone, the entry is freed with the connection.
        let _ = cs.tell(Msg::Push { handle, remote, access: bits, tag });
        Ok(())
    }

    /// The next memory the peer pushed ([`AsyncConnection::push`]), with its tag.
    ///
    /// # Errors
    /// [`Error::NoControlChannel`]; the connection's failure (or [`Error::Closed`]) once the
    /// peer is gone.
    pub async fn pushed(&self) -> Result<(u64, RemoteMemory)> {
        let cs = self.control()?;
        cs.next_pushed().await.ok_or_else(|| self.gone())
    }

    /// What this side lends the peer and holds of it now (all zero without a control channel).
    pub fn remote_memory_stats(&self) -> RemoteMemoryStats {
        let Ok(cs) = self.control() else { return RemoteMemoryStats::default() };
        let (lent_buffers, lent_bytes, lent_total) = cs.lent();
        let (held_buffers, held_bytes) = cs.held().now();
        RemoteMemoryStats { lent_buffers, lent_bytes, held_buffers, held_bytes, lent_total }
    }
}
