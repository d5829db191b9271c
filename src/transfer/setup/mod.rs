//! Connection setup: the TCP exchange and its listener (with background handshakes), RDMA CM,
//! the shared-secret handshake, and the control channel of the async front end.

pub(crate) mod acceptor;
pub(crate) mod auth;
pub(crate) mod cm;
pub(crate) mod control;
pub(crate) mod exchange;
pub(crate) mod handshake;
pub(crate) mod tcp;
