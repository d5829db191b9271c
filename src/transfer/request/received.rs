//! What an operation delivered: the one place a successful work completion's opcode, length and
//! immediate are interpreted, against what was posted into *that* buffer.
//!
//! Everything here comes from the NIC, and through it from the peer: a receive consumed by the
//! peer's RDMA WRITE with immediate reports the WRITE's length (its bytes went to the remote
//! address, none into the receive buffer), and no reported length is trusted beyond what was
//! posted. Every receive path — blocking, [`crate::transfer::Pending`], scatter, async, shared —
//! asks [`Received::interpret`] how many bytes of its buffer were written.

use crate::error::{Error, Result};
use crate::verbs::WcOpcode;

/// What kind of message consumed a receive (or, for operations of this side, that the operation
/// moved data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Arrival {
    /// Bytes were written into the buffer: a SEND (with or without immediate) filled the first
    /// [`Received::len`] bytes; for this side's own operations (WRITE, READ, SEND, atomics), the
    /// request moved [`Received::len`] bytes.
    Data,
    /// The peer's RDMA WRITE with immediate consumed the receive: its bytes went to the remote
    /// address it named, **none** into the receive buffer ([`Received::len`] is 0); only the
    /// immediate ([`Received::imm`]) arrived.
    ImmediateOnly,
}

/// What an operation delivered. For a receive: which kind of message arrived, how many bytes of
/// the posted buffer it wrote, and its immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Received {
    /// Bytes written into the receive buffer (never more than was posted; 0 for
    /// [`Arrival::ImmediateOnly`]). For this side's own operations: the bytes the request moved.
    pub len: usize,
    /// Immediate data, when the sender attached some (SEND or WRITE with immediate): always
    /// `Some` for [`Arrival::ImmediateOnly`].
    pub imm: Option<u32>,
    /// Which kind of message it was.
    pub kind: Arrival,
}

/// Which side of the queue pair a request was posted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Posted {
    /// A receive of this many bytes (all its SGEs together).
    Recv(usize),
    /// An RDMA READ filling this many bytes.
    Read(usize),
    /// Another send-queue request (WRITE, SEND, atomic) moving this many bytes.
    Send(usize),
}

impl Received {
    /// Whether only an immediate arrived (the peer's WRITE with immediate): no byte of the
    /// receive buffer was written.
    pub fn is_immediate_only(&self) -> bool {
        self.kind == Arrival::ImmediateOnly
    }

    /// Interprets a successful completion of a request posted as `posted`: the one function that
    /// turns a completion's opcode, `byte_len` and immediate into what the request delivered.
    ///
    /// A receive completed by a SEND reports at most the posted length; one consumed by a WRITE
    /// with immediate reports 0 bytes written (the completion's `byte_len` is the WRITE's length,
    /// not bytes in this buffer). A send-queue request reports its posted length (a successful
    /// READ wrote all of its target).
    ///
    /// # Errors
    /// [`Error::Protocol`] if the opcode does not belong to the queue the request was posted to
    /// (a device fault; nothing is reported written).
    pub(crate) fn interpret(opcode: WcOpcode, byte_len: u32, imm: Option<u32>, posted: Posted) -> Result<Received> {
        match (posted, opcode) {
            (Posted::Recv(len), WcOpcode::Recv) => {
                Ok(Received { len: (byte_len as usize).min(len), imm, kind: Arrival::Data })
            }
            (Posted::Recv(_), WcOpcode::RecvRdmaWithImm) => Ok(Received { len: 0, imm, kind: Arrival::ImmediateOnly }),
            (Posted::Read(len), WcOpcode::RdmaRead)
            | (Posted::Send(len), WcOpcode::Send | WcOpcode::RdmaWrite | WcOpcode::CompareSwap | WcOpcode::FetchAdd) => {
                Ok(Received { len, imm: None, kind: Arrival::Data })
            }
            (posted, opcode) => {
                Err(Error::Protocol(format!("a completion with opcode {opcode:?} for a request posted as {posted:?}")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_with_immediate_writes_nothing_into_the_receive() {
        for byte_len in [0, 200, 256, 1 << 20, u32::MAX] {
            let r = Received::interpret(WcOpcode::RecvRdmaWithImm, byte_len, Some(7), Posted::Recv(256)).unwrap();
            assert_eq!((r.len, r.imm, r.kind), (0, Some(7), Arrival::ImmediateOnly));
            assert!(r.is_immediate_only());
        }
    }

    #[test]
    fn a_send_reports_at_most_what_was_posted() {
        let r = Received::interpret(WcOpcode::Recv, 200, None, Posted::Recv(256)).unwrap();
        assert_eq!((r.len, r.kind), (200, Arrival::Data));
        let r = Received::interpret(WcOpcode::Recv, 1 << 20, Some(1), Posted::Recv(256)).unwrap();
        assert_eq!((r.len, r.imm), (256, Some(1)));
        let r = Received::interpret(WcOpcode::Recv, 5, None, Posted::Recv(0)).unwrap();
        assert_eq!(r.len, 0);
    }

    #[test]
    fn send_queue_requests_report_their_posted_length() {
        let r = Received::interpret(WcOpcode::RdmaRead, 12345, None, Posted::Read(64)).unwrap();
        assert_eq!((r.len, r.imm, r.kind), (64, None, Arrival::Data));
        let r = Received::interpret(WcOpcode::RdmaWrite, 0, None, Posted::Send(64)).unwrap();
        assert_eq!((r.len, r.kind), (64, Arrival::Data));
    }

    #[test]
    fn an_opcode_of_the_other_queue_is_refused() {
        assert!(matches!(Received::interpret(WcOpcode::RdmaRead, 64, None, Posted::Recv(64)), Err(Error::Protocol(_))));
        assert!(matches!(Received::interpret(WcOpcode::Recv, 64, None, Posted::Send(64)), Err(Error::Protocol(_))));
        assert!(Received::interpret(WcOpcode::Other(99), 1, None, Posted::Recv(64)).is_err());
        // A READ target is reported written only by a READ's completion.
        assert!(Received::interpret(WcOpcode::RdmaWrite, 64, None, Posted::Read(64)).is_err());
        assert!(Received::interpret(WcOpcode::RdmaRead, 64, None, Posted::Send(64)).is_err());
    }
}
