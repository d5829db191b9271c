//! A request as a value: the one place a work request is checked ([`Connection::request`]) and
//! the one place it becomes a verbs work request ([`Request::wr`]).
//!
//! Every front end — blocking, [`crate::transfer::Pending`], [`crate::transfer::Batch`], async —
//! turns its local memory into an [`SgeList`] (one buffer, or a gather/scatter list), names what
//! to do with it ([`Action`]: the verb with its remote side and immediate), and hands both to
//! [`Connection::request`]. What comes back is posted by `Connection::submit` (or
//! `try_submit`), and its completion is interpreted against [`Request::posted`].

pub(crate) mod iobuf;
pub(crate) mod local;
pub(crate) mod owned;
pub(crate) mod parts;
pub(crate) mod received;

use crate::error::{Error, Result};
use crate::remote::RemoteBuf;
use crate::transfer::request::received::Posted;
use crate::transfer::Connection;
use crate::verbs::{Access, RemoteAddr, SendFlags, SendOp, SendWr, Sge, Verb};

/// A request's local memory: none, one entry, or a scatter/gather list. (`pub` for the sealed
/// `Parts` trait only: unreachable from outside the crate.)
#[derive(Clone, Debug, Default)]
pub enum SgeList {
    /// No memory (a receive for an immediate only; the connection's own requests).
    #[default]
    Empty,
    /// One entry: the common case, no allocation.
    One(Sge),
    /// Several entries, in order.
    Many(Box<[Sge]>),
}

impl SgeList {
    /// The list from checked entries.
    pub(crate) fn from_vec(mut v: Vec<Sge>) -> SgeList {
        match v.len() {
            0 => SgeList::Empty,
            1 => SgeList::One(v.pop().expect("one entry")),
            _ => SgeList::Many(v.into_boxed_slice()),
        }
    }

    /// The entries, as posted.
    #[inline]
    pub(crate) fn as_slice(&self) -> &[Sge] {
        match self {
            SgeList::Empty => &[],
            SgeList::One(s) => std::slice::from_ref(s),
            SgeList::Many(v) => v,
        }
    }

    /// Bytes in all (a `u64`: a list may name more than one request can carry).
    #[inline]
    pub(crate) fn bytes(&self) -> u64 {
        self.as_slice().iter().map(|s| u64::from(s.len())).sum()
    }
}

/// What a request does with its local memory: the verb, with its remote side and immediate.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Action<'r> {
    /// RDMA WRITE of the list to `offset` in `remote`, with an immediate if given.
    Write { remote: &'r RemoteBuf, offset: u64, imm: Option<u32> },
    /// RDMA READ from `offset` in `remote` into the list.
    Read { remote: &'r RemoteBuf, offset: u64 },
    /// SEND of the list, with an immediate if given.
    Send { imm: Option<u32> },
    /// A receive into the list.
    Recv,
    /// A receive with no memory, for an immediate only (or an empty SEND).
    RecvImm,
    /// Fetch-and-add on the 8-byte word at `offset`; the old value lands in the list (8 bytes).
    FetchAdd { remote: &'r RemoteBuf, offset: u64, add: u64 },
    /// Compare-and-swap on the 8-byte word at `offset`; the old value lands in the list.
    CompareSwap { remote: &'r RemoteBuf, offset: u64, compare: u64, swap: u64 },
    /// A memory-less request of the connection's own (a window bind or invalidation).
    Control(SendOp),
}

impl Action<'_> {
    /// The right the peer's queue pair must grant for it: none for two-sided and the
    /// connection's own requests (a keepalive probe is built without a check, by
    /// [`Request::probe`]).
    #[inline]
    pub(crate) fn needs(&self) -> Option<Access> {
        match self {
            Action::Write { .. } => Some(Access::REMOTE_WRITE),
            Action::Read { .. } => Some(Access::REMOTE_READ),
            Action::FetchAdd { .. } | Action::CompareSwap { .. } => Some(Access::REMOTE_ATOMIC),
            Action::Send { .. } | Action::Recv | Action::RecvImm | Action::Control(_) => None,
        }
    }

    /// The verb, as errors name it.
    pub(crate) fn verb(&self) -> Verb {
        match self {
            Action::Write { imm: None, .. } => Verb::Write,
            Action::Write { imm: Some(_), .. } => Verb::WriteWithImm,
            Action::Read { .. } => Verb::Read,
            Action::Send { imm: None } => Verb::Send,
            Action::Send { imm: Some(_) } => Verb::SendWithImm,
            Action::Recv | Action::RecvImm => Verb::Recv,
            Action::FetchAdd { .. } => Verb::FetchAdd,
            Action::CompareSwap { .. } => Verb::CompareSwap,
            Action::Control(op) => op.verb(),
        }
    }
}

/// A checked request, ready to post: the verbs operation (`None`: a receive), its local memory,
/// its flags (inline or not: the tail's signal is added when a chain is posted) and what its
/// completion is interpreted against.
#[derive(Clone, Debug)]
pub(crate) struct Request {
    op: Option<SendOp>,
    sges: SgeList,
    flags: SendFlags,
}

// SAFETY: the only raw pointers a Request can hold are those of `SendOp::BindMw` (a window and a
// region): handles of verbs objects, which are thread-safe, read by `ibv_post_send` only; the
// window and the region outlive the request (the connection keeps the window until the key is
// released, or until its QP is flushed, in its drop; the region lives as long as the memory it
// opens). Everything else is plain data.
unsafe impl Send for Request {}

impl Request {
    /// Whether this is a receive-queue request.
    #[inline]
    pub(crate) fn is_recv(&self) -> bool {
        self.op.is_none()
    }

    /// What its completion is interpreted against (see `received.rs`).
    #[inline]
    pub(crate) fn posted(&self) -> Posted {
        let len = self.sges.bytes() as usize;
        match self.op {
            None => Posted::Recv(len),
            Some(SendOp::Read(_)) => Posted::Read(len),
            Some(_) => Posted::Send(len),
        }
    }

    /// The local memory.
    #[inline]
    pub(crate) fn sges(&self) -> &[Sge] {
        self.sges.as_slice()
    }

    /// Bytes of local memory it names (for the counters).
    #[inline]
    pub(crate) fn bytes(&self) -> u64 {
        self.sges.bytes()
    }

    /// Its operation's name (a chain is reported by its tail's).
    #[inline]
    pub(crate) fn name(&self) -> &'static str {
        self.op.map_or(Verb::Recv.name(), |op| op.name())
    }

    /// The connection's own memory-less marker (a SEND with no memory): signaled behind a
    /// partially accepted chain, its flush proves the chain flushed.
    pub(crate) fn marker() -> Request {
        Request { op: Some(SendOp::Send), sges: SgeList::Empty, flags: SendFlags::NONE }
    }

    /// A keepalive probe: a zero-length RDMA WRITE, with no memory and a remote key the
    /// responder does not check.
    pub(crate) fn probe() -> Request {
        let op = SendOp::Write(RemoteAddr { addr: 0, rkey: 0 });
        Request { op: Some(op), sges: SgeList::Empty, flags: SendFlags::NONE }
    }

    /// The send-queue work request, numbered `wr_id`, signaled if `signaled`: the one place one
    /// is built from a request. `None` for a receive.
    #[inline]
    pub(crate) fn wr(&self, wr_id: u64, signaled: bool) -> Option<SendWr<'_>> {
        let flags = if signaled { self.flags | SendFlags::SIGNALED } else { self.flags };
        Some(SendWr { wr_id, sges: self.sges.as_slice(), op: self.op?, flags })
    }
}

/// The remote word an atomic targets: in bounds and 8-byte aligned.
fn atomic_target(verb: Verb, remote: &RemoteBuf, offset: u64) -> Result<RemoteAddr> {
    let to = remote.at(offset, 8)?;
    if to.addr % 8 != 0 {
        return Err(Error::InvalidArgument(format!("{verb} needs an 8-byte-aligned remote word, got {:#x}", to.addr)));
    }
    Ok(to)
}

impl Connection {
    /// Checks `action` on `sges` and builds the request: the one place a request's shape is
    /// checked. The entries themselves were built by `Connection::sge_list` and friends
    /// (registered in this connection's PD, each under 4 GiB).
    ///
    /// # Errors
    /// Nothing is posted, the connection stays usable:
    /// - [`Error::InvalidArgument`]: no entries (or any, for a memory-less request), an
    ///   empty entry, more entries than the queue pair's scatter/gather limit, more than
    ///   4 GiB - 1 bytes in all, an atomic whose local word is not 8 bytes or whose remote word
    ///   is not 8-byte aligned, memory given to a connection-internal request;
    /// - [`Error::OutOfBounds`]: the remote range does not fit in the remote buffer;
    /// - [`Error::NotGranted`]: a WRITE, READ or atomic the peer's queue pair does not grant
    ///   ([`Connection::peer_grants`]).
    #[inline(always)]
    pub(crate) fn request(&self, action: Action<'_>, sges: SgeList) -> Result<Request> {
        if let Some(right) = action.needs().filter(|r| !self.peer_grants().contains(*r)) {
            return Err(Error::NotGranted { verb: action.verb(), right });
        }
        // The common case, one non-empty entry for an operation that takes memory, checks in a
        // few instructions (a front end's constant action folds the matches away); the rest in
        // `check_list`.
        let total = match &sges {
            SgeList::One(s) if !s.is_empty() && !matches!(action, Action::Control(_) | Action::RecvImm) => {
                u64::from(s.len())
            }
            _ => self.check_list(&action, &sges)?,
        };
        let verb = || action.verb();
        let len = total as usize;
        if matches!(action, Action::FetchAdd { .. } | Action::CompareSwap { .. }) && len != 8 {
            return Err(Error::InvalidArgument(format!("{} lands its old value in 8 bytes, got {len}", verb())));
        }
        let op = match action {
            Action::Write { remote, offset, imm } => {
                let to = remote.at(offset, total)?;
                imm.map_or(SendOp::Write(to), |imm| SendOp::WriteWithImm(to, imm))
            }
            Action::Read { remote, offset } => SendOp::Read(remote.at(offset, total)?),
            Action::Send { imm } => imm.map_or(SendOp::Send, SendOp::SendWithImm),
            Action::Recv | Action::RecvImm => {
                return Ok(Request { op: None, sges, flags: SendFlags::NONE });
            }
            Action::FetchAdd { remote, offset, add } => {
                SendOp::FetchAdd { remote: atomic_target(verb(), remote, offset)?, add }
            }
            Action::CompareSwap { remote, offset, compare, swap } => {
                let remote = atomic_target(verb(), remote, offset)?;
                SendOp::CompareSwap { remote, compare, swap }
            }
            Action::Control(op) => op,
        };
        // A payload of at most `qp.max_inline` bytes is copied into the work request at post time.
        let payload = matches!(op, SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write(_) | SendOp::WriteWithImm(..));
        let flags =
            if payload && len <= self.options().qp.max_inline as usize { SendFlags::INLINE } else { SendFlags::NONE };
        Ok(Request { op: Some(op), sges, flags })
    }

    /// [`Connection::request`]'s check of an entry list that is not one non-empty entry (or
    /// belongs to a memory-less request): count, emptiness, total. Returns the total.
    #[inline(never)]
    fn check_list(&self, action: &Action<'_>, sges: &SgeList) -> Result<u64> {
        let verb = action.verb();
        let parts = sges.as_slice();
        let caps = self.qp().caps();
        let max = match action {
            Action::Recv | Action::RecvImm => caps.max_recv_sge,
            // Devices bound a READ's scatter list on their own (`max_sge_rd`).
            Action::Read { .. } => self.max_read_sge(),
            _ => caps.max_send_sge,
        } as usize;
        match (action, parts.len()) {
            (Action::Control(_) | Action::RecvImm, 0) => {}
            (Action::Control(_) | Action::RecvImm, n) => {
                return Err(Error::InvalidArgument(format!("{verb} names no memory, got {n} entries")));
            }
            (_, n) if n == 0 || n > max => {
                return Err(Error::InvalidArgument(format!("a scatter/gather list holds 1..={max} parts, got {n}")));
            }
            _ => {}
        }
        if parts.iter().any(Sge::is_empty) {
            return Err(Error::InvalidArgument(format!("{verb} of zero bytes")));
        }
        let total = sges.bytes();
        if total > u64::from(u32::MAX) {
            return Err(Error::InvalidArgument(format!("one operation moves at most 4 GiB - 1, got {total} bytes")));
        }
        Ok(total)
    }
}
