//! The local side of a blocking or batched operation as one value: one piece of memory, or a
//! gather/scatter list of pieces that one work request carries in order.
//!
//! `conn.write(&buf, &remote, 0)` and `conn.write(&[&header[..], &payload[..]], &remote, 0)`
//! are the same operation: the list is written as the concatenation of its parts. Likewise a
//! READ or a receive scatters into `&mut [&mut a[..], &mut b[..]]`, filling the parts in order.
//! (The owned front ends — `Pending`, async — take lists of owned buffers instead: `owned.rs`.)

use crate::error::Result;
use crate::transfer::request::local::{sge_of, Local, LocalMut};
use crate::transfer::request::SgeList;
use crate::verbs::{Pd, Sge};

mod sealed {
    use crate::error::Result;
    use crate::transfer::request::SgeList;
    use crate::verbs::Pd;

    /// Memory the NIC may read: implemented here only, for [`Local`](super::Local) values
    /// and lists of shared borrows of them.
    pub trait Readable {}

    /// Memory the NIC may write: implemented here only, for
    /// [`LocalMut`](super::LocalMut) values and lists of exclusive borrows of them. (A type
    /// outside the crate cannot make itself a `Scatter` target by naming it.)
    pub trait Writable {}

    /// How a value of local memory becomes a request's scatter/gather list.
    pub trait Parts {
        /// The entries, each registered in `pd` (unchecked for count and emptiness: the
        /// request's check does that).
        fn sge_list(&self, pd: &Pd) -> Result<SgeList>;
    }
}

pub(crate) use sealed::Parts;

/// Memory the NIC reads for one request (the source of a WRITE or SEND): any [`Local`] value,
/// or a gather list of them — `[&L]`, `[&L; N]` or `Vec<&L>` — sent or written as the
/// concatenation of its parts, in order. Slices of heap memory mix freely with whole heap
/// buffers (`&[&header[..16], &payload]`: a `&Buffer` is a `&[u8]` there). Parts of other
/// kinds go as `&dyn Local` — sized values only, so a range of a heap buffer goes as a
/// [`BufSlice`](crate::heap::BufSlice) (`buffer.slice(..16)?`):
/// `conn.send(&[&registered as &dyn Local, &buffer, &file])`.
///
/// A list holds at most as many parts as the queue pair has send scatter/gather entries
/// (`qp().caps().max_send_sge`, at least 4), each non-empty, with at most 4 GiB - 1 bytes in
/// all; anything else is refused with [`crate::Error::InvalidArgument`] before it is posted.
/// Implemented here only (sealed: implement [`Local`] for your own memory).
///
/// This is the borrowed form, for the blocking calls and [`Batch`](crate::transfer::Batch).
/// The non-blocking and async operations take a list too, owned: a `Vec<B>` or `[B; N]` of
/// [`IoBuf`](crate::transfer::IoBuf)s (`conn.post_send(vec![header, payload])`), given back
/// whole.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is no local memory the NIC may read for one request",
    label = "not one `Local` buffer, nor a list (`[&L]`, `[&L; N]`, `Vec<&L>`) of them",
    note = "registered memory: heap `Buffer`s, slices of heap memory, `RegisteredBuf`s, mapped files"
)]
pub trait Gather: sealed::Parts + sealed::Readable {}

/// Memory the NIC writes for one request (the target of a READ or receive): any [`LocalMut`]
/// value, or a scatter list of them — `[&mut L]`, `[&mut L; N]` or `Vec<&mut L>` — filled in
/// order (the first
/// part, then the next, ...). At most `qp().caps().max_recv_sge` parts for a receive (at
/// least 4); for a READ, `max_send_sge` bounded by the device's `max_sge_rd` (iWARP devices
/// allow a single entry). Implemented here only (sealed: implement [`LocalMut`] for your own
/// memory).
///
/// This is the borrowed form, for the blocking calls and [`Batch`](crate::transfer::Batch).
/// The non-blocking and async operations take an owned list: a `Vec<B>` or `[B; N]` of
/// [`IoTarget`](crate::transfer::IoTarget)s (`conn.post_recv(vec![header, body])`), filled in
/// order and given back whole.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is no local memory the NIC may write for one request",
    label = "not one `LocalMut` buffer, nor a list of exclusive borrows (`[&mut L]`, `[&mut L; N]`, `Vec<&mut L>`)",
    note = "the NIC writes a READ's or receive's target: every part must be borrowed `&mut`"
)]
pub trait Scatter: sealed::Parts + sealed::Writable {}

fn list_of<'a, L: Local + ?Sized + 'a>(parts: impl Iterator<Item = &'a L>, pd: &Pd) -> Result<SgeList> {
    parts.map(|p| sge_of(p, pd)).collect::<Result<Vec<Sge>>>().map(SgeList::from_vec)
}

impl<L: Local + ?Sized> sealed::Parts for L {
    #[inline]
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        sge_of(self, pd).map(SgeList::One)
    }
}
impl<L: Local + ?Sized> sealed::Parts for [&L] {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        list_of(self.iter().copied(), pd)
    }
}
impl<L: Local + ?Sized, const N: usize> sealed::Parts for [&L; N] {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        list_of(self.iter().copied(), pd)
    }
}
impl<L: Local + ?Sized> sealed::Parts for Vec<&L> {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        list_of(self.iter().copied(), pd)
    }
}
impl<L: Local + ?Sized> sealed::Parts for [&mut L] {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        list_of(self.iter().map(|p| &**p), pd)
    }
}
impl<L: Local + ?Sized, const N: usize> sealed::Parts for [&mut L; N] {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        list_of(self.iter().map(|p| &**p), pd)
    }
}

impl<L: Local + ?Sized> sealed::Parts for Vec<&mut L> {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        list_of(self.iter().map(|p| &**p), pd)
    }
}

impl<L: Local + ?Sized> sealed::Readable for L {}
impl<L: Local + ?Sized> sealed::Readable for [&L] {}
impl<L: Local + ?Sized, const N: usize> sealed::Readable for [&L; N] {}
impl<L: Local + ?Sized> sealed::Readable for Vec<&L> {}

impl<L: LocalMut + ?Sized> sealed::Writable for L {}
impl<L: LocalMut + ?Sized> sealed::Writable for [&mut L] {}
impl<L: LocalMut + ?Sized, const N: usize> sealed::Writable for [&mut L; N] {}
impl<L: LocalMut + ?Sized> sealed::Writable for Vec<&mut L> {}

impl<L: Local + ?Sized> Gather for L {}
impl<L: Local + ?Sized> Gather for [&L] {}
impl<L: Local + ?Sized, const N: usize> Gather for [&L; N] {}
impl<L: Local + ?Sized> Gather for Vec<&L> {}

impl<L: LocalMut + ?Sized> Scatter for L {}
impl<L: LocalMut + ?Sized> Scatter for [&mut L] {}
impl<L: LocalMut + ?Sized, const N: usize> Scatter for [&mut L; N] {}
impl<L: LocalMut + ?Sized> Scatter for Vec<&mut L> {}
