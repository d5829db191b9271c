//! Per-connection counters, read as a [`ConnectionStats`] snapshot.

/// A snapshot of one connection's activity ([`crate::transfer::Connection::stats`]): what was
/// posted, what completed, what failed, what is in flight. Counted by the connection itself
/// (under the queue locks it takes anyway), from its creation on; the connection's control
/// traffic, if any (an async connection's remote-memory messages), counts separately on its
/// own connection.
///
/// More fields may come in later versions (`#[non_exhaustive]`): read the ones you need.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionStats {
    /// Send-queue work requests posted: WRITEs, READs, SENDs, atomics, window binds and
    /// invalidations, each request of a batch (not the connection's own marker requests).
    pub send_requests: u64,
    /// Bytes of local memory those requests named (what a WRITE or SEND carries, what a READ
    /// or atomic fetches into).
    pub send_bytes: u64,
    /// Receives posted.
    pub recv_requests: u64,
    /// Bytes SENDs delivered into completed receives (`byte_len`). A receive consumed by the
    /// peer's WRITE with immediate adds nothing: that WRITE's bytes went to remote-accessible
    /// memory, not into the receive's buffer.
    pub recv_bytes: u64,
    /// Work completions reaped with success, both queues (a batch or an unsignaled chain
    /// completes once).
    pub completions: u64,
    /// Work completions reaped with an error status, flushes included (the first one fails
    /// the connection; [`crate::transfer::Connection::error`] says why). A keepalive probe
    /// that failed counts; a flushed one does not.
    pub errors: u64,
    /// Send-queue slots in use now: requests posted and not yet completed (a keepalive probe
    /// out takes one).
    pub sends_in_flight: u32,
    /// Receives posted and not yet completed.
    pub recvs_in_flight: u32,
}

/// What one queue counts (kept in the queue's state, under its lock).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct QueueCounts {
    pub(crate) requests: u64,
    pub(crate) bytes: u64,
    pub(crate) completions: u64,
    pub(crate) errors: u64,
}

impl ConnectionStats {
    pub(crate) fn from_queues(send: QueueCounts, send_used: u32, recv: QueueCounts, recv_used: u32) -> ConnectionStats {
        ConnectionStats {
            send_requests: send.requests,
            send_bytes: send.bytes,
            recv_requests: recv.requests,
            recv_bytes: recv.bytes,
            completions: send.completions + recv.completions,
            errors: send.errors + recv.errors,
            sends_in_flight: send_used,
            recvs_in_flight: recv_used,
        }
    }
}
