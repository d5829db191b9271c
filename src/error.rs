//! The crate's error type.

use crate::verbs::{WcOpcode, WcStatus};

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
    /// Registering a new heap chunk with the NIC failed (often the memlock limit).
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

/// Why the shared-secret check of a connection setup failed ([`Error::Authentication`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthFailure {
    /// The peer requires a shared secret and this side has none.
    #[error("the peer requires a shared secret and this side has none (set SetupOptions::secret)")]
    NoLocalSecret,
    /// This side requires a shared secret and the peer has none.
    #[error("this side requires a shared secret and the peer has none")]
    NoPeerSecret,
    /// The peer's proof does not match this side's secret: the two secrets differ, or the
    /// messages were altered or replayed.
    #[error(
        "the peer's proof does not match this side's secret (a different secret, or altered or replayed messages)"
    )]
    WrongSecret,
}

fn fmt_hint(hint: &Option<String>) -> String {
    match hint {
        Some(h) => format!("; hint: {h}"),
        None => String::new(),
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
            | Error::RemoteRefused { .. } => K::PermissionDenied,
            Error::InvalidArgument(_) | Error::NotRegistered { .. } | Error::OutOfBounds { .. } => K::InvalidInput,
            Error::Protocol(_) | Error::MalformedEndpoint(_) => K::InvalidData,
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
            Error::MalformedEndpoint { .. } => "MalformedEndpoint",
            Error::NoActiveDevice { .. } => "NoActiveDevice",
            Error::NoControlChannel => "NoControlChannel",
            Error::NoRemoteAccess => "NoRemoteAccess",
            Error::NoSuchDevice { .. } => "NoSuchDevice",
            Error::NoSuchIndex { .. } => "NoSuchIndex",
            Error::NoWholeChunkAccess => "NoWholeChunkAccess",
            Error::NotRegistered { .. } => "NotRegistered",
            Error::Operation { .. } => "Operation",
            Error::OutOfBounds { .. } => "OutOfBounds",
            Error::OutOfMemory { .. } => "OutOfMemory",
            Error::PartialPost { .. } => "PartialPost",
            Error::Protocol { .. } => "Protocol",
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

/// Why a connection was found dead ([`Error::Disconnected`]). mralloc watches every connection
/// from one background thread: its setup TCP stream (a peer process that exits or drops the
/// connection closes it), its RDMA CM events, the device's asynchronous events and, if asked
/// for, keepalive probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disconnect {
    /// The peer closed the TCP connection the RDMA connection was set up over: its process
    /// dropped the connection or exited.
    PeerClosed,
    /// The setup TCP connection failed with this errno (e.g. `ECONNRESET`).
    PeerReset {
        /// The socket error.
        errno: i32,
    },
    /// RDMA CM reported the connection disconnected (the peer disconnected or exited).
    CmDisconnected,
    /// RDMA CM reported that the device was removed.
    DeviceRemoved,
    /// The device reported its port down (`IBV_EVENT_PORT_ERR`).
    PortDown {
        /// The port.
        port: u8,
    },
    /// The device reported the connection's queue pair or a CQ in error
    /// (`IBV_EVENT_QP_FATAL`, `_QP_REQ_ERR`, `_QP_ACCESS_ERR`, `_PATH_MIG_ERR`, `_CQ_ERR`).
    QpError {
        /// The event, as `ibv_event_type_str` names it.
        event: &'static str,
    },
    /// The device reported a fatal error (`IBV_EVENT_DEVICE_FATAL`).
    DeviceFatal,
    /// A keepalive probe ([`crate::transfer::Options::keepalive`]) failed with `status`:
    /// `RETRY_EXC_ERR` when the peer's NIC did not answer within the transport's retries, or
    /// `RESP_TIMEOUT_ERR` when it did not within two intervals (its host, its NIC or the path is
    /// gone); `REM_INV_REQ_ERR` when the peer refused the probe (it did not enable keepalive).
    KeepaliveFailed {
        /// The probe's completion status.
        status: crate::verbs::WcStatus,
    },
}

impl std::fmt::Display for Disconnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Disconnect::PeerClosed => write!(f, "the peer closed its connection or exited"),
            Disconnect::PeerReset { errno } => {
                write!(f, "the setup connection failed: {}", std::io::Error::from_raw_os_error(*errno))
            }
            Disconnect::CmDisconnected => write!(f, "RDMA CM reported a disconnect"),
            Disconnect::DeviceRemoved => write!(f, "the RDMA device was removed"),
            Disconnect::PortDown { port } => write!(f, "port {port} of the RDMA device went down"),
            Disconnect::QpError { event } => write!(f, "the device reported {event}"),
            Disconnect::DeviceFatal => write!(f, "the RDMA device reported a fatal error"),
            Disconnect::KeepaliveFailed { status: crate::verbs::WcStatus::RemInvReqErr } => {
                write!(f, "the peer refused a keepalive probe (it did not enable keepalive)")
            }
            Disconnect::KeepaliveFailed { status } => {
                write!(f, "a keepalive probe failed ({status:?}): the peer's host, NIC or the path is gone")
            }
        }
    }
}

/// The current `RLIMIT_MEMLOCK` soft limit in bytes (`None` = unlimited or unknown).
pub(crate) fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own; RLIMIT_MEMLOCK is a valid resource.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    }
}

/// A human description of the memlock limit, for hints.
pub(crate) fn memlock_text() -> String {
    match memlock_limit() {
        Some(b) => format!("RLIMIT_MEMLOCK is {b} bytes ({} KiB)", b / 1024),
        None => "RLIMIT_MEMLOCK is unlimited".to_string(),
    }
}

/// What a failed operation's status most often means, and where to look (empty if nothing
/// useful can be said). The statuses come from the remote side's NIC or the transport; the
/// names are the verbs' (`Verb::name`).
fn operation_hint(op: &str, status: crate::verbs::WcStatus) -> &'static str {
    use crate::verbs::WcStatus as S;
    let one_sided = op.starts_with("RDMA") || op.ends_with("-and-add") || op.ends_with("-and-swap");
    match status {
        S::RemInvReqErr if op.starts_with("RDMA WRITE") => {
            ". Hint: the peer's queue pair refused the WRITE: the side whose memory is written sets \
             QpOptions::remote_access with REMOTE_WRITE (default NONE); or the WRITE exceeds the peer's range"
        }
        S::RemInvReqErr if op == "RDMA READ" => {
            ". Hint: the peer's queue pair refused the READ: the side whose memory is read sets \
             QpOptions::remote_access with REMOTE_READ (default NONE)"
        }
        S::RemInvReqErr if one_sided => {
            ". Hint: the peer's queue pair refused the atomic: the side whose memory is updated sets \
             QpOptions::remote_access with REMOTE_ATOMIC (default NONE); the target must be 8-byte aligned"
        }
        S::RemInvReqErr => ". Hint: a SEND larger than the receive buffer the peer had posted",
        S::RemAccessErr => {
            ". Hint: the peer's memory does not grant this: a key that was revoked or never matched, a \
             range outside the exposed or granted buffer, memory exposed without this right, or (on \
             some devices) the peer's QpOptions::remote_access lacking it"
        }
        S::RnrRetryExcErr => {
            ". Hint: the peer had no receive posted for a SEND (QpOptions::rnr_retry: 7 waits for ever)"
        }
        S::RetryExcErr => ". Hint: the peer did not answer (its process or host is gone, or the path is down)",
        _ => "",
    }
}

fn hint_for(verb: &'static str, errno: i32) -> Option<String> {
    match (verb, errno) {
        ("ibv_reg_mr", libc::ENOMEM) | ("ibv_reg_mr", libc::EPERM) | ("ibv_reg_mr", libc::EAGAIN) => Some(format!(
            "registered memory is pinned and counts against the memlock limit; {} \
                 (raise it with `ulimit -l unlimited` or limits.conf)",
            memlock_text()
        )),
        (_, libc::EACCES) | (_, libc::EPERM) => {
            Some("permission denied on /dev/infiniband/uverbs*: run as a user allowed to use RDMA".into())
        }
        ("ibv_create_qp", libc::EINVAL) | ("ibv_create_cq", libc::EINVAL) => {
            Some("a requested queue depth, SGE count or inline size exceeds the device limits".into())
        }
        ("ibv_modify_qp", libc::EINVAL) => {
            Some("the device rejected the QP attributes: check the remote endpoint, port, GID index and MTU".into())
        }
        ("ibv_post_send", libc::ENOMEM) | ("ibv_post_recv", libc::ENOMEM) => {
            Some("the queue is full: reap completions before posting more".into())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_the_message() {
        let e = Error::NoActiveDevice { available: vec![] };
        let d = format!("{e:?}");
        assert!(d.starts_with(&e.to_string()) && d.ends_with("[Error::NoActiveDevice]"), "{d}");
    }

    #[test]
    fn a_refused_operation_names_the_right_it_needs() {
        let refused = |op| Error::Operation { op, wr_id: 1, status: WcStatus::RemInvReqErr, vendor_err: 0 }.to_string();
        assert!(refused("RDMA WRITE").contains("REMOTE_WRITE"), "{}", refused("RDMA WRITE"));
        assert!(refused("RDMA WRITE with immediate").contains("REMOTE_WRITE"));
        assert!(refused("RDMA READ").contains("REMOTE_READ"));
        assert!(refused("fetch-and-add").contains("REMOTE_ATOMIC"));
        assert!(refused("compare-and-swap").contains("REMOTE_ATOMIC"));
        assert!(refused("SEND").contains("receive buffer"));
        let other = Error::Operation { op: "RDMA WRITE", wr_id: 1, status: WcStatus::LocLenErr, vendor_err: 0 };
        assert!(!other.to_string().contains("Hint"), "no hint where none helps: {other}");
    }

    #[test]
    fn reg_mr_enomem_hint_names_memlock() {
        let e = Error::verbs_errno("ibv_reg_mr", libc::ENOMEM);
        let s = e.to_string();
        assert!(s.contains("ibv_reg_mr failed"), "{s}");
        assert!(s.contains("RLIMIT_MEMLOCK"), "{s}");
        assert_eq!(e.errno(), Some(libc::ENOMEM));
    }

    #[test]
    fn no_such_device_lists_available() {
        let e = Error::NoSuchDevice { name: "mlx9".into(), available: vec!["rxe0".into(), "mlx5_0".into()] };
        assert_eq!(e.to_string(), "RDMA device \"mlx9\" not found; available devices: rxe0, mlx5_0");
        let e = Error::NoSuchDevice { name: "x".into(), available: vec![] };
        assert!(e.to_string().ends_with("available devices: none"));
    }
}

/// Why a peer refused a request for remote memory ([`Error::RemoteRefused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RemoteRefusal {
    /// The peer serves no remote memory on this connection.
    NotServing = 1,
    /// More than the peer grants in one request.
    TooLarge = 2,
    /// The peer's limit on memory lent through this connection is reached.
    LimitReached = 3,
    /// The peer's heap could not allocate it.
    OutOfMemory = 4,
    /// Rights the peer's connection or heap does not allow (its `QpOptions::remote_access`, or
    /// a heap without `Access::MW_BIND`).
    Rights = 5,
    /// Making the key failed at the peer (binding a memory window, or registering the buffer).
    Unavailable = 6,
}

impl RemoteRefusal {
    /// Decodes a refusal code.
    pub fn from_code(c: u8) -> Option<RemoteRefusal> {
        Some(match c {
            1 => RemoteRefusal::NotServing,
            2 => RemoteRefusal::TooLarge,
            3 => RemoteRefusal::LimitReached,
            4 => RemoteRefusal::OutOfMemory,
            5 => RemoteRefusal::Rights,
            6 => RemoteRefusal::Unavailable,
            _ => return None,
        })
    }

    fn describe(&self) -> &'static str {
        match self {
            RemoteRefusal::NotServing => "it serves no remote memory",
            RemoteRefusal::TooLarge => "larger than it grants at once",
            RemoteRefusal::LimitReached => "its limit for this connection is reached",
            RemoteRefusal::OutOfMemory => "its heap is out of memory",
            RemoteRefusal::Rights => "rights its connection or heap does not allow",
            RemoteRefusal::Unavailable => "making a remote key for the memory failed",
        }
    }
}
