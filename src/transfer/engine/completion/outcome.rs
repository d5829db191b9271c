//! What a completion reported ([`Completed`]) and what failed a connection ([`Failure`]): the
//! values the engine hands to waiters.

use crate::error::{Disconnect, Error, Result};
use crate::transfer::request::received::{Posted, Received};
use crate::verbs::{WcOpcode, WcStatus};

/// What a successful completion reported, as the NIC said it: not yet interpreted against what
/// was posted (a receive's `byte_len` may name bytes that went elsewhere — see
/// [`Received`](crate::transfer::Received), which every operation reports instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completed {
    /// The completion's `byte_len`, unchecked.
    pub byte_len: u32,
    /// Immediate data, if the peer attached some.
    pub imm: Option<u32>,
    /// The completion's opcode.
    pub opcode: WcOpcode,
}

impl Completed {
    /// What the request, posted as `posted`, delivered ([`Received::interpret`]).
    ///
    /// # Errors
    /// [`Error::Protocol`] if the opcode does not belong to the request's queue.
    pub(crate) fn delivered(&self, posted: Posted) -> Result<Received> {
        Received::interpret(self.opcode, self.byte_len, self.imm, posted)
    }

    /// [`Completed::delivered`], and the target `buf` (of a READ or a receive) learns through
    /// `fill` how many bytes of it the NIC wrote: the one place a target's contents follow a
    /// completion.
    ///
    /// # Safety
    /// `self` is the successful completion of the request posted as `posted` into `buf`.
    ///
    /// # Errors
    /// As [`Completed::delivered`] (nothing is recorded written then).
    pub(crate) unsafe fn deliver_into<B>(
        &self,
        buf: &mut B,
        posted: Posted,
        fill: Option<Filled<B>>,
    ) -> Result<Received> {
        let got = self.delivered(posted)?;
        if let Some(fill) = fill {
            // SAFETY: the caller's contract, and `got.len` is what the request wrote from the
            // start of the target, bounded by the posted length (a READ: all of it; a receive:
            // what a SEND delivered, 0 for a WRITE with immediate).
            unsafe { fill(buf, got.len) };
        }
        Ok(got)
    }
}

/// [`IoTarget::filled`](crate::transfer::IoTarget::filled) of a target type, as a plain
/// function pointer (so that holders such as `Pending` need no bound on the type).
pub(crate) type Filled<B> = unsafe fn(&mut B, usize);

/// The first failure of a connection; every later post reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// A work request failed (its completion status), or mralloc's operation timeout expired
    /// (`RESP_TIMEOUT_ERR`).
    Op { op: &'static str, wr_id: u64, status: WcStatus, vendor_err: u32 },
    /// A verbs call of the completion path failed (`ibv_poll_cq`, `ibv_req_notify_cq`,
    /// `ibv_get_cq_event`, or a partially refused `ibv_post_send`).
    Verbs { verb: &'static str, errno: i32 },
    /// [`crate::transfer::Connection::close`] was called.
    Closed,
    /// The connection watcher found the connection dead.
    Lost(Disconnect),
}

impl Failure {
    pub(crate) fn error(&self) -> Error {
        match *self {
            Failure::Op { op, wr_id, status, vendor_err } => Error::Operation { op, wr_id, status, vendor_err },
            Failure::Verbs { verb, errno } => Error::verbs_errno(verb, errno),
            Failure::Closed => Error::Closed,
            Failure::Lost(why) => Error::Disconnected(why),
        }
    }

    /// The failure recorded for a local error (a failing verbs call) of the completion path.
    pub(crate) fn local(e: &Error) -> Failure {
        match e {
            Error::Verbs { verb, errno, .. } => Failure::Verbs { verb, errno: *errno },
            Error::PartialPost { verb, errno, .. } => Failure::Verbs { verb, errno: *errno },
            Error::Timeout(_, what) => {
                Failure::Op { op: what, wr_id: 0, status: WcStatus::RespTimeoutErr, vendor_err: 0 }
            }
            _ => Failure::Verbs { verb: "the completion path", errno: libc::EIO },
        }
    }
}

pub(crate) type Outcome = std::result::Result<Completed, Failure>;
