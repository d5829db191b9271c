//! The details some errors carry: why a connection was lost ([`Disconnect`]), why
//! authentication failed ([`AuthFailure`]), why a peer refused remote memory ([`RemoteRefusal`]),
//! what is wrong with a remote descriptor ([`DescFault`]).

/// Why the shared-secret check of a connection setup failed ([`Error::Authentication`](crate::Error::Authentication)).
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

/// Why a connection was found dead ([`Error::Disconnected`](crate::Error::Disconnected)). mralloc watches every connection
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

/// Why a peer refused a request for remote memory ([`Error::RemoteRefused`](crate::Error::RemoteRefused)).
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

    pub(super) fn describe(&self) -> &'static str {
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

/// What is wrong with a remote descriptor ([`Error::MalformedDescriptor`](crate::Error::MalformedDescriptor)):
/// one decoded from a peer's bytes ([`crate::RemoteDesc::from_bytes`]) or one being built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescFault {
    /// The first byte names a format version this build does not speak.
    #[error("unsupported version {0} (this build speaks {v})", v = crate::RemoteDesc::VERSION)]
    Version(u8),
    /// Fewer bytes than the header and the entries it announces.
    #[error("truncated: {got} bytes, the descriptor needs {need}")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes the header (and the count in it, if there was one) calls for.
        need: usize,
    },
    /// Bytes after the last entry.
    #[error("{0} bytes after the last entry")]
    Trailing(usize),
    /// No device key at all.
    #[error("no device key")]
    NoKeys,
    /// More device keys than a descriptor carries ([`crate::RemoteDesc::MAX_DEVICES`]).
    #[error("{0} device keys (at most {max})", max = crate::RemoteDesc::MAX_DEVICES)]
    TooMany(usize),
    /// Two keys for the same device identity (GID).
    #[error("two keys for the device at GID {0}")]
    DuplicateDevice(crate::verbs::Gid),
    /// A key for the all-zero GID, which names no device.
    #[error("a key for the all-zero GID")]
    ZeroGid,
    /// `addr + len` wraps around the address space.
    #[error("the range {addr:#x}+{len} wraps around")]
    Wraps {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
}
