//! Scoped remote grants: a type 2 memory window over exactly one buffer, revocable.

use crate::error::{Error, Result};
use crate::heap::mr_of;
use crate::remote::RemoteBuf;
use crate::transfer::local::LocalMut;
use crate::transfer::Connection;
use crate::verbs::{Access, Mw, SendFlags, SendOp, Sge};

/// Remote access to one buffer through one connection, with an rkey of its own (a type 2
/// memory window bound to just that buffer). The grant owns the buffer; [`Grant::revoke`]
/// invalidates the rkey and gives the buffer back. Dropping a grant revokes it; forgetting it
/// leaks the buffer (never exposes freed memory).
///
/// The buffer must come from a heap built with [`Access::MW_BIND`] (and the rights to grant).
pub struct Grant<'c, B: LocalMut> {
    conn: &'c Connection,
    mw: Option<Mw>,
    remote: RemoteBuf,
    buf: Option<B>,
}

impl<B: LocalMut> Grant<'_, B> {
    /// What the peer needs: address, length and the window's rkey.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Invalidates the rkey (later remote accesses fail with a remote access error) and returns
    /// the buffer.
    pub fn revoke(mut self) -> Result<B> {
        self.invalidate()?;
        Ok(self.buf.take().expect("a grant holds its buffer until revoked"))
    }

    fn invalidate(&mut self) -> Result<()> {
        let Some(mw) = self.mw.take() else { return Ok(()) };
        // SAFETY: LOCAL_INV touches no local memory.
        let id = unsafe {
            self.conn.post_chain(
                "memory window invalidate",
                &[Sge::new(0, 0, 0)],
                &[SendOp::LocalInvalidate(self.remote.rkey)],
                SendFlags::NONE,
            )?
        };
        let r = self.conn.wait_send(id).map(|_| ());
        drop(mw); // deallocation invalidates it in any case
        r
    }
}

impl<B: LocalMut> Drop for Grant<'_, B> {
    fn drop(&mut self) {
        if self.mw.is_some() {
            if let Err(e) = self.invalidate() {
                tracing::warn!("revoking a grant failed ({e}); its window was deallocated");
            }
        }
    }
}

impl Connection {
    /// Grants the peer `access` (remote read and/or write) to exactly `buf`, through this
    /// connection only, with a fresh rkey. The heap must have been built with
    /// [`Access::MW_BIND`] in its access rights.
    pub fn grant<B: LocalMut>(&self, buf: B, access: Access) -> Result<Grant<'_, B>> {
        self.check()?;
        let (ptr, len) = (buf.local_ptr(), buf.local_len());
        crate::transfer::ops::nonempty(len, "grant")?;
        let (mr, _) = mr_of(ptr, &self.pd).ok_or(Error::NotRegistered { addr: ptr as u64 })?;
        if access.contains(Access::LOCAL_WRITE) || !access.is_remote() {
            return Err(Error::InvalidArgument("a grant gives remote read and/or write rights only".into()));
        }
        let mw = Mw::new(&self.pd)?;
        let rkey = mw.next_rkey();
        let op = SendOp::BindMw { mw: mw.as_raw(), rkey, mr, addr: ptr as u64, len: len as u64, access: access.bits() };
        // SAFETY: binding touches no local memory; the window covers `buf`, which the grant owns
        // until the window is invalidated.
        let id = unsafe { self.post_chain("memory window bind", &[Sge::new(0, 0, 0)], &[op], SendFlags::NONE)? };
        self.wait_send(id)?;
        Ok(Grant {
            conn: self,
            mw: Some(mw),
            remote: RemoteBuf { addr: ptr as u64, len: len as u64, rkey },
            buf: Some(buf),
        })
    }
}
