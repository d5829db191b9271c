//! The local side of a non-blocking or async operation as one owned value: one buffer, or a
//! gather/scatter list of owned buffers that one work request carries in order.
//!
//! `conn.post_send(payload)` and `conn.post_send(vec![header, payload])` are the same
//! operation: the list is sent as the concatenation of its parts, and the `Pending` (or the
//! future) gives the whole list back. A READ or a receive into `vec![a, b]` fills `a`, then `b`.
//! The operation owns every part until the NIC is done with all of them: a dropped `Pending` or
//! cancelled future parks the whole list with the connection, a forgotten one leaks it.
//!
//! Accepted: any single [`IoBuf`] (a source) or [`IoTarget`] (a target), and `Vec<B>` or
//! `[B; N]` of them. Borrowed parts are not: a list of references is no `IoBuf` list (a
//! forgotten `Pending` would end the borrows while the NIC still used the memory). The parts
//! of a target cannot alias: each part owns its range exclusively by the [`IoTarget`] (and
//! [`IoBufMut`](super::iobuf::IoBufMut)) contract, so two of them never name the same byte
//! (only shared owners such as `Arc` or `Bytes` could, and they are sources only).

use crate::error::Result;
use crate::transfer::request::iobuf::{IoBuf, IoTarget};
use crate::transfer::request::local::sge_of_parts;
use crate::transfer::request::SgeList;
use crate::verbs::{Pd, Sge};

mod sealed {
    use crate::error::Result;
    use crate::transfer::request::SgeList;
    use crate::verbs::Pd;

    /// How an owned source becomes a request's gather list (private: seals [`OwnedGather`](super::OwnedGather)).
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is no owned memory the NIC may read for a non-blocking or async operation",
        label = "not one owned `IoBuf`, nor a list (`Vec<B>`, `[B; N]`) of owned `IoBuf`s",
        note = "an operation that may outlive its call owns its memory: no references, in a list or alone"
    )]
    pub trait Source: Send + 'static {
        /// The entries, each registered in `pd` (unchecked for count and emptiness: the
        /// request's check does that).
        fn sge_list(&self, pd: &Pd) -> Result<SgeList>;
    }

    /// How an owned target becomes a request's scatter list, and learns what landed in it
    /// (private: seals [`OwnedScatter`](super::OwnedScatter)).
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is no owned memory the NIC may write for a non-blocking or async operation",
        label = "not one owned `IoTarget` (an `IoBufMut`, an `UninitBuffer`), nor a list (`Vec<B>`, `[B; N]`) of them",
        note = "the NIC writes a READ's or receive's target: every part must be owned and writable"
    )]
    pub trait Target: Send + 'static {
        /// The entries, each registered in `pd` (unchecked for count and emptiness).
        fn target_list(&mut self, pd: &Pd) -> Result<SgeList>;

        /// Records that the NIC wrote the first `n` bytes of the target: the parts in order,
        /// each up to its length.
        ///
        /// # Safety
        /// The first `n` bytes of the concatenated parts were written, and `n` is at most
        /// their total length.
        unsafe fn filled(&mut self, n: usize);
    }
}

pub(crate) use sealed::{Source, Target};

/// Owned memory the NIC reads for one non-blocking or async request (`post_write`,
/// `post_send`, the async `write`/`send`): one [`IoBuf`], or a gather list of them — `Vec<B>`
/// or `[B; N]` — sent or written as the concatenation of its parts; the operation gives the
/// whole value back. Sealed (implement [`IoBuf`] for your own memory); name it to write
/// functions that take "one buffer or a list":
///
/// ```no_run
/// use mralloc::transfer::{Connection, OwnedGather};
///
/// /// Sends `parts` (one buffer, a `Vec` or an array of them) as one message; gives them back.
/// fn send_all<B: OwnedGather>(conn: &Connection, parts: B) -> mralloc::Result<B> {
///     Ok(conn.post_send(parts)?.wait()?.0)
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is no owned memory the NIC may read for a non-blocking or async operation",
    label = "not one owned `IoBuf`, nor a list (`Vec<B>`, `[B; N]`) of owned `IoBuf`s",
    note = "an operation that may outlive its call owns its memory: no references, in a list or alone"
)]
pub trait OwnedGather: sealed::Source {}
impl<T: sealed::Source> OwnedGather for T {}

/// Owned memory the NIC writes for one non-blocking or async request (`post_read`,
/// `post_recv`, the async `read`/`recv`): one [`IoTarget`], or a scatter list of them —
/// `Vec<B>` or `[B; N]` — filled in order; the operation gives the whole value back. Sealed
/// (implement [`IoTarget`] for your own memory).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is no owned memory the NIC may write for a non-blocking or async operation",
    label = "not one owned `IoTarget` (an `IoBufMut`, an `UninitBuffer`), nor a list (`Vec<B>`, `[B; N]`) of them",
    note = "the NIC writes a READ's or receive's target: every part must be owned and writable"
)]
pub trait OwnedScatter: sealed::Target {}
impl<T: sealed::Target> OwnedScatter for T {}

/// The entry of one owned source.
#[inline]
fn source_sge<B: IoBuf>(buf: &B, pd: &Pd) -> Result<Sge> {
    sge_of_parts(buf.stable_ptr(), buf.bytes_len(), buf.lkey_for(pd), pd)
}

/// The entry of one owned target.
#[inline]
fn target_sge<B: IoTarget>(buf: &mut B, pd: &Pd) -> Result<Sge> {
    let (ptr, len) = buf.target();
    sge_of_parts(ptr.cast_const(), len, buf.target_lkey(pd), pd)
}

/// `n` bytes written across `parts`, in order: each part learns what landed in it.
///
/// # Safety
/// As [`OwnedScatter::filled`] for the parts as one target.
unsafe fn fill_in_order<'a, B: IoTarget + 'a>(parts: impl Iterator<Item = &'a mut B>, n: usize) {
    let mut left = n;
    for part in parts {
        let here = left.min(part.target().1);
        // SAFETY: the first `n` bytes of the concatenation were written (the caller's
        // contract), so this part's first `here` bytes were, and `here` is at most its length.
        unsafe { part.filled(here) };
        left -= here;
    }
}

impl<B: IoBuf> Source for B {
    #[inline]
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        source_sge(self, pd).map(SgeList::One)
    }
}

impl<B: IoBuf> Source for Vec<B> {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        self.iter().map(|b| source_sge(b, pd)).collect::<Result<Vec<Sge>>>().map(SgeList::from_vec)
    }
}

impl<B: IoBuf, const N: usize> Source for [B; N] {
    fn sge_list(&self, pd: &Pd) -> Result<SgeList> {
        self.iter().map(|b| source_sge(b, pd)).collect::<Result<Vec<Sge>>>().map(SgeList::from_vec)
    }
}

impl<B: IoTarget> Target for B {
    #[inline]
    fn target_list(&mut self, pd: &Pd) -> Result<SgeList> {
        target_sge(self, pd).map(SgeList::One)
    }

    #[inline]
    unsafe fn filled(&mut self, n: usize) {
        // SAFETY: the caller's contract, for this one part.
        unsafe { IoTarget::filled(self, n) }
    }
}

impl<B: IoTarget> Target for Vec<B> {
    fn target_list(&mut self, pd: &Pd) -> Result<SgeList> {
        self.iter_mut().map(|b| target_sge(b, pd)).collect::<Result<Vec<Sge>>>().map(SgeList::from_vec)
    }

    unsafe fn filled(&mut self, n: usize) {
        // SAFETY: the caller's contract.
        unsafe { fill_in_order(self.iter_mut(), n) }
    }
}

impl<B: IoTarget, const N: usize> Target for [B; N] {
    fn target_list(&mut self, pd: &Pd) -> Result<SgeList> {
        self.iter_mut().map(|b| target_sge(b, pd)).collect::<Result<Vec<Sge>>>().map(SgeList::from_vec)
    }

    unsafe fn filled(&mut self, n: usize) {
        // SAFETY: the caller's contract.
        unsafe { fill_in_order(self.iter_mut(), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target that records what it was told was written.
    struct Recorded {
        bytes: Box<[u8]>,
        filled: Option<usize>,
    }

    // SAFETY: the Box owns its bytes, which do not move with the value; no key is ever given
    // (nothing is posted in these tests).
    unsafe impl IoTarget for Recorded {
        fn target(&mut self) -> (*mut u8, usize) {
            (self.bytes.as_mut_ptr(), self.bytes.len())
        }
        fn target_lkey(&self, _: &Pd) -> Option<u32> {
            None
        }
        unsafe fn filled(&mut self, n: usize) {
            assert!(n <= self.bytes.len(), "told {n} bytes of a {}-byte part were written", self.bytes.len());
            self.filled = Some(n);
        }
    }

    fn parts(lens: &[usize]) -> Vec<Recorded> {
        lens.iter().map(|&n| Recorded { bytes: vec![0; n].into_boxed_slice(), filled: None }).collect()
    }

    fn told(parts: &[Recorded]) -> Vec<Option<usize>> {
        parts.iter().map(|p| p.filled).collect()
    }

    #[test]
    fn a_scatter_target_learns_its_parts_filled_in_order() {
        for (n, want) in [
            (0, [Some(0), Some(0), Some(0)]),
            (3, [Some(3), Some(0), Some(0)]),
            (4, [Some(4), Some(0), Some(0)]),
            (7, [Some(4), Some(3), Some(0)]),
            (13, [Some(4), Some(8), Some(1)]),
            (14, [Some(4), Some(8), Some(2)]),
        ] {
            let mut list = parts(&[4, 8, 2]);
            // SAFETY: `n` is at most the 14 bytes of the parts (no memory is read).
            unsafe { Target::filled(&mut list, n) };
            assert_eq!(told(&list), want, "{n} bytes over parts of 4, 8, 2");

            let mut array: [Recorded; 3] = parts(&[4, 8, 2]).try_into().ok().unwrap();
            // SAFETY: as above.
            unsafe { Target::filled(&mut array, n) };
            assert_eq!(told(&array), want, "{n} bytes over an array of 4, 8, 2");
        }
        // One part: told exactly what landed.
        let mut one = parts(&[16]).pop().unwrap();
        // SAFETY: 9 <= 16.
        unsafe { Target::filled(&mut one, 9) };
        assert_eq!(one.filled, Some(9));
    }
}
