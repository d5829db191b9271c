//! The rails' transfer calls: one buffer or a list of pieces, written or read, striped.

#[cfg(doc)]
use crate::error::Error;
use crate::remote_desc::RemoteDesc;
use crate::transfer::rails::{Rails, Striped};
use crate::transfer::request::iobuf::{IoBuf, IoTarget, Rejected};

impl Rails {
    /// Starts an RDMA WRITE of all of `buf` to `offset` in `remote`, striped over the rails.
    ///
    /// # Errors
    /// With `buf` back, untouched, in [`Rejected`]: [`Error::InvalidArgument`] (no bytes),
    /// [`Error::OutOfBounds`] (the range does not fit in `remote`), or why no rail reaches it
    /// ([`Error::NotRegistered`]: not in a heap bound to a rail's PD; [`Error::NoKeyForDevice`]:
    /// `remote` has no key for the peer's device of any rail; [`Error::RailsDown`]: every rail
    /// failed). What happens after is in [`Striped::wait`].
    pub fn post_write<B: IoBuf>(
        &self,
        buf: B,
        remote: &RemoteDesc,
        offset: u64,
    ) -> std::result::Result<Striped<B>, Rejected<B>> {
        let len = buf.bytes_len() as u64;
        match remote.slice(offset..offset.saturating_add(len)) {
            Ok(to) => self.post_write_list(vec![(buf, to)]).single(),
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }

    /// Starts an RDMA READ filling all of `buf` from `offset` in `remote`, striped over the
    /// rails. The target may be uninitialised memory: after a successful transfer all of it is.
    ///
    /// # Errors
    /// As [`Rails::post_write`].
    pub fn post_read<B: IoTarget>(
        &self,
        buf: B,
        remote: &RemoteDesc,
        offset: u64,
    ) -> std::result::Result<Striped<B>, Rejected<B>> {
        let mut buf = buf;
        let len = buf.target().1 as u64;
        match remote.slice(offset..offset.saturating_add(len)) {
            Ok(from) => self.post_read_list(vec![(buf, from)]).single(),
            Err(error) => Err(Rejected { error, buf: Some(buf) }),
        }
    }

    /// Starts one transfer of many pieces: each buffer written, whole, to the start of its
    /// remote range (which must be at least as long; cut one with [`RemoteDesc::slice`]). A
    /// piece of at most [`RailOptions::slice`](crate::transfer::RailOptions::slice) bytes goes
    /// whole, on one rail. The pieces are cut and spread over the
    /// rails as one; [`Striped::wait`] reports each piece's outcome. A piece no rail can take
    /// (empty, too long for its range, not registered, no key) fails alone, before anything
    /// is posted.
    pub fn post_write_list<B: IoBuf>(&self, pieces: Vec<(B, RemoteDesc)>) -> Striped<B> {
        let mut bufs = Vec::with_capacity(pieces.len());
        let mut made = Vec::with_capacity(pieces.len());
        for (buf, to) in pieces {
            made.push(self.piece(buf.stable_ptr() as u64, buf.bytes_len() as u64, &to, |pd| buf.lkey_for(pd)));
            bufs.push(buf);
        }
        Striped::start(self.group(), bufs, made, false, None)
    }

    /// Starts one transfer of many pieces: each buffer filled, whole, from the start of its
    /// remote range. As [`Rails::post_write_list`] otherwise.
    pub fn post_read_list<B: IoTarget>(&self, pieces: Vec<(B, RemoteDesc)>) -> Striped<B> {
        let mut bufs = Vec::with_capacity(pieces.len());
        let mut made = Vec::with_capacity(pieces.len());
        for (mut buf, from) in pieces {
            let (ptr, len) = buf.target();
            made.push(self.piece(ptr as u64, len as u64, &from, |pd| buf.target_lkey(pd)));
            bufs.push(buf);
        }
        Striped::start(self.group(), bufs, made, true, Some(<B as IoTarget>::filled))
    }
}
