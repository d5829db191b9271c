//! Finding dead connections: the connection watcher (run on the process's one liveness thread,
//! `crate::verbs::liveness`) and keepalive probes.

pub(crate) mod keepalive;
pub(crate) mod link;
pub(crate) mod source;
pub(crate) mod watch;
