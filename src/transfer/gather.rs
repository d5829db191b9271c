//! Scatter/gather on borrowed memory: one SEND or WRITE gathering several local buffers (a
//! header and a payload, say, from different allocations), one receive scattering into several.
//! Like the other blocking calls, each returns only once the NIC is done with every part.

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::local::{Local, LocalMut, Sges};
use crate::transfer::received::{Posted, Received};
use crate::transfer::Connection;
use crate::verbs::{SendOp, Sge, Verb};

impl Connection {
    /// One SEND of `parts`, in order, as a single message (the peer receives their
    /// concatenation). At most as many parts as the QP has send scatter/gather entries
    /// (`qp().caps().max_send_sge`: at least 4), each non-empty and registered in
    /// [`Connection::pd`]. Slices (`&[u8]`) take ranges of any heap buffers; parts of
    /// different kinds (a heap buffer and a [`crate::verbs::RegisteredBuf`], say) go as
    /// `&dyn Local`: `conn.send_gather::<dyn Local>(&[&registered, &buffer])`. Small messages
    /// (up to [`Options::max_inline`](crate::transfer::Options::max_inline) bytes in all) go
    /// inline.
    ///
    /// ```no_run
    /// # fn f(conn: &mralloc::transfer::Connection, header: &mralloc::Buffer, payload: &mralloc::Buffer) -> mralloc::Result<()> {
    /// conn.send_gather(&[&header[..16], &payload[..]])?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Connection::send`]; also [`Error::InvalidArgument`] for no parts, more parts than
    /// the QP's scatter/gather entries, or more than 4 GiB - 1 bytes in all (nothing posted).
    pub fn send_gather<L: Local + ?Sized>(&self, parts: &[&L]) -> Result<()> {
        let sges = self.gathered(parts, Verb::Send)?;
        self.gather_and_wait(&sges, SendOp::Send).map(|_| ())
    }

    /// One RDMA WRITE of `parts`, in order, to `offset` bytes into `remote` (bounds-checked
    /// for their total length).
    ///
    /// # Errors
    /// As [`Connection::write_at`]; also [`Error::InvalidArgument`] as for
    /// [`Connection::send_gather`].
    pub fn write_gather_at<L: Local + ?Sized>(&self, parts: &[&L], remote: &RemoteBuf, offset: u64) -> Result<()> {
        let sges = self.gathered(parts, Verb::Write)?;
        let to = remote.at(offset, total(&sges)?)?;
        self.gather_and_wait(&sges, SendOp::Write(to)).map(|_| ())
    }

    /// Posts one receive scattering into `parts` (filled in order: the first part, then the
    /// next, ...) and waits for a SEND to fill it. [`Received::len`] is the total. At most
    /// `qp().caps().max_recv_sge` parts (at least 4; the device may give sends more).
    ///
    /// # Errors
    /// As [`Connection::recv`]; also [`Error::InvalidArgument`] as for
    /// [`Connection::send_gather`] (receive entries instead of send entries).
    pub fn recv_scatter<L: LocalMut + ?Sized>(&self, parts: &mut [&mut L]) -> Result<Received> {
        self.check()?;
        let max = self.qp().caps().max_recv_sge as usize;
        count(parts.len(), max)?;
        let sges = parts.iter().map(|p| self.checked(&**p, Verb::Recv)).collect::<Result<Vec<Sge>>>()?;
        let posted = total(&sges)? as usize;
        // SAFETY: `parts` are exclusively borrowed until the receive is claimed below
        // (wait_borrowed waits for the flush on any error, aborts if it never comes).
        let t = unsafe { self.post_recv_raw(&sges)? };
        self.wait_borrowed(t)?.delivered(Posted::Recv(posted))
    }

    /// The SGEs of `parts` for `verb` (checked: count, each non-empty and registered).
    fn gathered<L: Local + ?Sized>(&self, parts: &[&L], verb: Verb) -> Result<Vec<Sge>> {
        self.check()?;
        count(parts.len(), self.qp().caps().max_send_sge as usize)?;
        let sges = parts.iter().map(|p| self.checked(*p, verb)).collect::<Result<Vec<Sge>>>()?;
        total(&sges)?;
        Ok(sges)
    }

    /// Posts one request naming every SGE and waits for it, as every blocking operation does
    /// ([`Connection::post_and_wait_borrowed`]); inline when small.
    fn gather_and_wait(&self, sges: &[Sge], op: SendOp) -> Result<crate::transfer::Completed> {
        let flags = self.inline_flag(&op, total(sges)? as usize);
        self.post_and_wait_borrowed(Sges::Gather(sges), &[op], flags)
    }
}

fn count(n: usize, max: usize) -> Result<()> {
    if n == 0 || n > max {
        return Err(Error::InvalidArgument(format!("a scatter/gather list holds 1..={max} parts, got {n}")));
    }
    Ok(())
}

/// The total length of `sges`, which one request can carry (below 4 GiB).
fn total(sges: &[Sge]) -> Result<u64> {
    let sum: u64 = sges.iter().map(|s| u64::from(s.len())).sum();
    if sum > u64::from(u32::MAX) {
        return Err(Error::InvalidArgument(format!("one operation moves at most 4 GiB - 1, got {sum} bytes")));
    }
    Ok(sum)
}
