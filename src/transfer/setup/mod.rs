//! Connection setup: the TCP exchange (written once, run by a blocking, a `poll(2)` and a tokio
//! driver) and its listeners, RDMA CM, the shared-secret handshake, and the control channel of
//! the async front end.

pub(crate) mod acceptor;
pub(crate) mod auth;
pub(crate) mod backoff;
pub(crate) mod cm;
pub(crate) mod control;
pub(crate) mod exchange;
pub(crate) mod handshake;
pub(crate) mod polling;
pub(crate) mod tcp;
#[cfg(feature = "tokio")]
pub(crate) mod tokio_wire;
pub(crate) mod wire;
