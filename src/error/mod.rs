//! The crate's error type.

use crate::verbs::{Access, Verb, WcOpcode, WcStatus};

mod detail;
mod hints;
pub use detail::{AuthFailure, DescFault, Disconnect, RemoteRefusal};
pub(crate) use hints::memlock_text;
use hints::{hint_for, operation_hint};

/// Result alias used throughout mralloc.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in mralloc, as a typed value.
///
/// Each variant carries enough to act on: which verb failed and the OS error behind it, which
/// devices exist when the one asked for does not, the work-completion status name when the NIC
/// reported a failure.
///
/// `Debug` prints the message too (with the variant's name), so `fn main() -> mralloc::Result<()>`
/// shows what went wrong and what to do rather than a struct dump.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verbs call failed.
    #[error("{verb} failed: {text} (errno {errno}){}", fmt_hint(.hint))]
    Verbs {
        /// The libibverbs function that failed, e.g. `ibv_reg_mr`.
        verb: &'static str,
        /// The `errno` it left.
        errno: i32,
        /// `strerror(errno)`.
        text: String,
        /// What probably caused it, where that is known (e.g. the memlock limit).
        hint: Option<String>,
    },
    /// No RDMA device has the requested name.
    #[error("RDMA device {name:?} not found; available devices: {}", fmt_list(.available))]
    NoSuchDevice {
        /// The name asked for.
        name: String,
        /// The devices that do exist.
        available: Vec<String>,
    },
    /// No device with an active port exists.
    #[error("no RDMA device with an ACTIVE port (devices: {}); without a NIC, run under scripts/softroce", fmt_list(.available))]
    NoActiveDevice {
        /// The devices that exist (none of them active).
        available: Vec<String>,
    },
    /// A port or GID index outside what the device offers.
    #[error("{what} {index} does not exist on {device} (valid: {valid})")]
    NoSuchIndex {
        /// `"port"` or `"GID index"`.
        what: &'static str,
        /// The index asked for.
        index: u32,
        /// The device name.
        device: String,
        /// The valid range, e.g. `"1..=1"`.
        valid: String,
    },
    /// A work request completed with an error status.
    #[error("work request {wr_id} ({opcode:?}) failed: {} (vendor error {vendor_err:#x})", .status.name())]
    WorkCompletion {
        /// The `wr_id` the request was posted with.
        wr_id: u64,
        /// The completion status reported by the NIC.
        status: WcStatus,
        /// The opcode of the completion (only meaningful for some failures).
        opcode: WcOpcode,
        /// Provider-specific detail.
        vendor_err: u32,
    },
    /// An operation of a connection failed (or the connection had already failed).
    #[error(
        "{op} (work request {wr_id}) failed: {} (vendor error {vendor_err:#x}); the connection is unusable{}",
        .status.name(),
        operation_hint(op, *status)
    )]
    Operation {
        /// What was being done, e.g. `"RDMA WRITE"`.
        op: &'static str,
        /// The work request that failed first.
        wr_id: u64,
        /// Its completion status (`REM_ACCESS_ERR`, `RETRY_EXC_ERR`, ...; `RESP_TIMEOUT_ERR` when
        /// mralloc's own operation timeout expired).
        status: WcStatus,
        /// Provider-specific detail.
        vendor_err: u32,
    },
    /// A connection's queue pair was moved to the error state, but the device never reported the
    /// flush of a request that uses local memory. The memory may still be the NIC's: owned
    /// buffers are leaked rather than freed or handed back (a device or driver fault).
    #[error(
        "the device did not flush work request {wr_id} within {waited:?} after its queue pair was moved to the \
         error state; its memory was leaked, not released"
    )]
    FlushLost {
        /// The request whose completion never came.
        wr_id: u64,
        /// How long mralloc waited for it after failing the queue pair.
        waited: std::time::Duration,
    },
    /// The connection was closed ([`crate::transfer::Connection::close`]).
    #[error("the connection was closed")]
    Closed,
    /// The connection was found dead without an operation of it failing: the peer went away,
    /// the device or port failed (see [`Disconnect`]). Every operation in flight was flushed.
    #[error("the connection is lost: {0}")]
    Disconnected(Disconnect),
    /// A fork()ed child used an object its parent made ({0}): the parent's heaps, connections
    /// and verbs objects stay the parent's (their memory and queues are not the child's). The
    /// child may make its own.
    #[error("{0} belongs to the parent of this fork()ed process; make a new one in the child")]
    Forked(&'static str),
    /// The RDMA device was removed (`rdma link delete`, a driver unbound, a NIC unplugged):
    /// nothing new can be made on it. See [`crate::verbs::Context::is_removed`].
    #[error("the RDMA device {device} was removed")]
    DeviceRemoved {
        /// The device's name.
        device: String,
    },
    /// `ibv_post_send` accepted only the first `posted` requests of a chain (`bad_wr` pointed at
    /// the next one). The accepted ones were flushed before this error was returned.
    #[error("{verb} accepted {posted} of {total} requests, then failed: {text} (errno {errno})")]
    PartialPost {
        /// The verb, `ibv_post_send`.
        verb: &'static str,
        /// Requests the device accepted (those before `bad_wr`).
        posted: usize,
        /// Requests in the chain.
        total: usize,
        /// The `errno` it returned.
        errno: i32,
        /// `strerror(errno)`.
        text: String,
    },
    /// A one-sided request needs a right the peer's queue pair does not grant this connection
    /// ([`crate::transfer::Connection::peer_grants`]): refused before anything was posted, the
    /// connection stays usable. The peer grants it in its
    /// [`crate::transfer::QpOptions::remote_access`].
    #[error(
        "the peer does not grant {} on this connection, which {verb} needs: nothing was posted \
         (the peer grants it with QpOptions::remote_access on its side)",
        right_name(*.right)
    )]
    NotGranted {
        /// The request's verb.
        verb: Verb,
        /// The missing right: [`Access::REMOTE_WRITE`], [`Access::REMOTE_READ`] or
        /// [`Access::REMOTE_ATOMIC`].
        right: Access,
    },
    /// A peer sent something that is not a valid mralloc connection message.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The shared-secret check of a TCP connection setup failed (see
    /// [`crate::transfer::SetupOptions::secret`]). Both sides report it, before any queue pair is
    /// connected or any blob handed to the application.
    #[error("connection authentication failed: {0}")]
    Authentication(AuthFailure),
    /// Waiting for completions took longer than allowed.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(std::time::Duration, &'static str),
    /// An argument was rejected before anything was posted.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A peer's endpoint description could not be decoded.
    #[error("malformed endpoint: {0}")]
    MalformedEndpoint(String),
    /// A remote descriptor ([`crate::RemoteDesc`]) could not be decoded or built.
    #[error("malformed remote descriptor: {0}")]
    MalformedDescriptor(DescFault),
    /// A remote descriptor holds no key for the device a connection reaches (the GID of the
    /// peer's end of it).
    #[error("the remote descriptor has no key for the device at GID {gid} (it has keys for: {})", fmt_list(.have))]
    NoKeyForDevice {
        /// The GID of the peer's end of the connection.
        gid: crate::verbs::Gid,
        /// The GIDs the descriptor has keys for.
        have: Vec<String>,
    },
    /// Every rail of a [`crate::transfer::Rails`] group that could carry a piece failed.
    #[error("no live rail can carry the piece: {}", fmt_list(.failures))]
    RailsDown {
        /// Each rail that reached the piece, with its failure.
        failures: Vec<String>,
    },
    /// Pieces of a rails transfer failed ([`crate::transfer::Finished::into_result`]).
    #[error("{failed} of {pieces} pieces failed; the first: {first}")]
    PiecesFailed {
        /// How many failed.
        failed: usize,
        /// How many the transfer had.
        pieces: usize,
        /// The first failed piece's error.
        first: Box<Error>,
    },
    /// Registering a heap chunk with the NIC failed (often the memlock limit): a new chunk, an
    /// idle chunk registered again, or one registered on a bind or on its first use through a
    /// PD; the hint says which.
    #[error("memory registration failed: {} (errno {errno}); {hint}", std::io::Error::from_raw_os_error(*.errno))]
    Registration {
        /// The errno `ibv_reg_mr` left.
        errno: i32,
        /// What to do about it, with the current memlock limit.
        hint: String,
    },
    /// The heap's configured limit on mapped bytes would be exceeded.
    #[error("heap limit exceeded: {requested} more bytes needed, {mapped} of {limit} bytes already mapped")]
    LimitExceeded {
        /// The limit set with `HeapBuilder::limit`.
        limit: usize,
        /// Bytes mapped when the request came.
        mapped: usize,
        /// Bytes the request needed.
        requested: usize,
    },
    /// The allocator had no memory to give.
    #[error("out of memory allocating {requested} bytes: {why}")]
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// Why.
        why: &'static str,
    },
    /// Memory that no heap registered (or a heap bound to no PD) was used where keys are needed.
    #[error("memory at {addr:#x} is not registered: allocate it from a bound mralloc heap")]
    NotRegistered {
        /// The address.
        addr: u64,
    },
    /// A buffer was to be exposed, but its heap was built without the remote right that needs
    /// (`REMOTE_READ` for `Buffer::remote`, any remote right for `Buffer::expose`).
    #[error(
        "the heap was built without the remote right this needs: use HeapBuilder::access(... REMOTE_*) to expose its buffers"
    )]
    NoRemoteAccess,
    /// An earlier revocation of a buffer's remote key was refused by the device: the key may
    /// still work, so the buffer's memory is never reused.
    #[error("a remote key of this buffer could not be revoked earlier: its memory stays reachable and is leaked")]
    RevocationFailed,
    /// A chunk-wide rkey was asked of a heap whose chunks are registered for local access only.
    #[error(
        "the heap's chunks have no remote rights: Buffer::expose exposes one buffer; chunk-wide keys need \
         HeapBuilder::remote_access_to_whole_chunks"
    )]
    NoWholeChunkAccess,
    /// The peer refused a request for remote memory (its own limits, or it serves none).
    #[error("the peer refused {requested} bytes of remote memory: {reason} (limit {limit})", reason = .reason.describe())]
    RemoteRefused {
        /// Bytes asked for.
        requested: u64,
        /// Why.
        reason: RemoteRefusal,
        /// For [`RemoteRefusal::TooLarge`] the peer's largest grant, for
        /// [`RemoteRefusal::LimitReached`] the bytes it would still lend; otherwise 0.
        limit: u64,
    },
    /// Remote memory was asked of a connection without a control channel: its peer is not an
    /// async connection (a blocking `Connection`, `Listener` or `CmListener`).
    #[error("the connection has no control channel: remote memory needs async connections on both sides (AsyncListener / AsyncConnection::connect, AsyncCmListener / AsyncConnection::connect_cm, or AsyncConnection::pair)")]
    NoControlChannel,
    /// A range lies outside the buffer it refers to.
    #[error("range of {len} bytes at offset {offset} is outside the {size}-byte buffer")]
    OutOfBounds {
        /// Start offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Size of the buffer.
        size: u64,
    },
    /// A jemalloc control call failed.
    #[error("jemalloc {what} failed: {detail}")]
    Jemalloc {
        /// The mallctl name.
        what: String,
        /// jemalloc's explanation of the error code.
        detail: String,
    },
    /// An I/O error outside the verbs (e.g. mmap, sysfs).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

fn fmt_hint(hint: &Option<String>) -> String {
    match hint {
        Some(h) => format!("; hint: {h}"),
        None => String::new(),
    }
}

fn right_name(right: Access) -> &'static str {
    if right == Access::REMOTE_WRITE {
        "REMOTE_WRITE"
    } else if right == Access::REMOTE_READ {
        "REMOTE_READ"
    } else if right == Access::REMOTE_ATOMIC {
        "REMOTE_ATOMIC"
    } else {
        "a remote right"
    }
}

fn fmt_list(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_string()
    } else {
        items.join(", ")
    }
}

impl Error {
    /// Builds a [`Error::Verbs`] from the current `errno` (or `ret` when a verb returns the error
    /// number directly, as `ibv_post_send` and `ibv_modify_qp` do).
    pub(crate) fn verbs(verb: &'static str, ret: i32) -> Error {
        let errno = if ret > 0 { ret } else { std::io::Error::last_os_error().raw_os_error().unwrap_or(0) };
        Error::verbs_errno(verb, errno)
    }

    /// Builds a [`Error::Verbs`] for a known errno, with a hint where one is known.
    pub(crate) fn verbs_errno(verb: &'static str, errno: i32) -> Error {
        let text = std::io::Error::from_raw_os_error(errno).to_string();
        Error::Verbs { verb, errno, text, hint: hint_for(verb, errno) }
    }

    /// The completion status, if this error came from a failed work completion.
    pub fn wc_status(&self) -> Option<WcStatus> {
        match self {
            Error::WorkCompletion { status, .. } | Error::Operation { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The errno, if this error came from a failed verb or system call.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verbs { errno, .. } => Some(*errno),
            Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

impl Error {
    /// The [`std::io::ErrorKind`] closest to this error (what [`From<Error> for std::io::Error`]
    /// uses): `NotFound` for a missing device or index, `TimedOut`, `PermissionDenied` for
    /// authentication and remote rights, `InvalidInput` for arguments and ranges, `InvalidData`
    /// for a peer's malformed messages, `OutOfMemory` for limits, `NotConnected` for a closed
    /// connection, the errno's kind for failed verbs and system calls, `Other` otherwise.
    pub fn io_kind(&self) -> std::io::ErrorKind {
        use std::io::ErrorKind as K;
        let of_errno = |errno: i32| std::io::Error::from_raw_os_error(errno).kind();
        match self {
            Error::Verbs { errno, .. } | Error::PartialPost { errno, .. } | Error::Registration { errno, .. } => {
                of_errno(*errno)
            }
            Error::Io { source, .. } => source.kind(),
            Error::NoSuchDevice { .. } | Error::NoActiveDevice { .. } | Error::NoSuchIndex { .. } => K::NotFound,
            Error::Timeout(..) => K::TimedOut,
            Error::Authentication(_)
            | Error::NoRemoteAccess
            | Error::NoWholeChunkAccess
            | Error::RemoteRefused { .. }
            | Error::NotGranted { .. } => K::PermissionDenied,
            Error::InvalidArgument(_) | Error::NotRegistered { .. } | Error::OutOfBounds { .. } => K::InvalidInput,
            Error::Protocol(_) | Error::MalformedEndpoint(_) | Error::MalformedDescriptor(_) => K::InvalidData,
            Error::NoKeyForDevice { .. } => K::NotFound,
            Error::RailsDown { .. } => K::NotConnected,
            Error::PiecesFailed { first, .. } => first.io_kind(),
            Error::LimitExceeded { .. } | Error::OutOfMemory { .. } => K::OutOfMemory,
            Error::Closed => K::NotConnected,
            Error::Disconnected(Disconnect::PeerReset { .. }) => K::ConnectionReset,
            Error::Disconnected(_) => K::ConnectionAborted,
            Error::NoControlChannel => K::Unsupported,
            _ => K::Other,
        }
    }
}

/// An [`Error`] as a [`std::io::Error`], for code that speaks `io::Result`: the kind from
/// [`Error::io_kind`], and the mralloc error inside (`get_ref()` / `into_inner()` and
/// `downcast`), so nothing is lost.
///
/// ```
/// let e: std::io::Error = mralloc::Error::Closed.into();
/// assert_eq!(e.kind(), std::io::ErrorKind::NotConnected);
/// assert!(matches!(e.get_ref().and_then(|e| e.downcast_ref::<mralloc::Error>()), Some(mralloc::Error::Closed)));
/// ```
impl From<Error> for std::io::Error {
    fn from(e: Error) -> std::io::Error {
        std::io::Error::new(e.io_kind(), e)
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self} [Error::{}]", self.variant_name())
    }
}

impl Error {
    fn variant_name(&self) -> &'static str {
        match self {
            Error::Authentication { .. } => "Authentication",
            Error::Closed => "Closed",
            Error::DeviceRemoved { .. } => "DeviceRemoved",
            Error::Disconnected { .. } => "Disconnected",
            Error::FlushLost { .. } => "FlushLost",
            Error::Forked { .. } => "Forked",
            Error::InvalidArgument { .. } => "InvalidArgument",
            Error::Io { .. } => "Io",
            Error::Jemalloc { .. } => "Jemalloc",
            Error::LimitExceeded { .. } => "LimitExceeded",
            Error::MalformedDescriptor { .. } => "MalformedDescriptor",
            Error::MalformedEndpoint { .. } => "MalformedEndpoint",
            Error::NoActiveDevice { .. } => "NoActiveDevice",
            Error::NoControlChannel => "NoControlChannel",
            Error::NoKeyForDevice { .. } => "NoKeyForDevice",
            Error::NoRemoteAccess => "NoRemoteAccess",
            Error::NoSuchDevice { .. } => "NoSuchDevice",
            Error::NoSuchIndex { .. } => "NoSuchIndex",
            Error::NoWholeChunkAccess => "NoWholeChunkAccess",
            Error::NotGranted { .. } => "NotGranted",
            Error::NotRegistered { .. } => "NotRegistered",
            Error::Operation { .. } => "Operation",
            Error::OutOfBounds { .. } => "OutOfBounds",
            Error::OutOfMemory { .. } => "OutOfMemory",
            Error::PartialPost { .. } => "PartialPost",
            Error::PiecesFailed { .. } => "PiecesFailed",
            Error::Protocol { .. } => "Protocol",
            Error::RailsDown { .. } => "RailsDown",
            Error::Registration { .. } => "Registration",
            Error::RemoteRefused { .. } => "RemoteRefused",
            Error::RevocationFailed => "RevocationFailed",
            Error::Timeout { .. } => "Timeout",
            Error::Verbs { .. } => "Verbs",
            Error::WorkCompletion { .. } => "WorkCompletion",
        }
    }
}

/// An I/O error of the caller's own (a file read, a socket), so `?` works on it in a function
/// that returns [`crate::Result`]: [`Error::Io`], with `what` saying only that it was I/O.
///
/// ```
/// fn load(path: &str) -> mralloc::Result<Vec<u8>> {
///     Ok(std::fs::read(path)?)
/// }
/// assert!(matches!(load("/no/such/file"), Err(mralloc::Error::Io { .. })));
/// ```
impl From<std::io::Error> for Error {
    fn from(source: std::io::Error) -> Error {
        Error::Io { what: "I/O".into(), source }
    }
}

#[cfg(test)]
mod tests;
