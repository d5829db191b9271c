//! [`Request`]: what an async operation has still to post, as a value the backlog can hold
//! while the send queue is full.

use crate::verbs::{SendOp, Sge};

/// What is still to be posted.
#[derive(Clone, Copy)]
pub(crate) struct Request {
    /// `None`: no memory (a receive for an immediate only).
    pub(crate) sge: Option<Sge>,
    /// `None`: a receive.
    pub(crate) what: Option<SendOp>,
}

impl Request {
    /// The SGE a send-side post carries (an empty one posts no scatter/gather list).
    pub(crate) fn send_sge(&self) -> Sge {
        self.sge.unwrap_or(Sge::new(0, 0, 0))
    }
}

// SAFETY: the only raw pointers a Request can hold are those of `SendOp::BindMw` (a window and a
// region): handles of verbs objects, which are thread-safe, read by `ibv_post_send` only; the
// window and the region outlive the request (the connection keeps the window until the key is
// released, or until its QP is flushed, in its drop; the chunk's region lives as long as the lent
// buffer, an exact region as long as its key). Everything else is plain data.
unsafe impl Send for Request {}
