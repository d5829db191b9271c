//! The completion engine: posting checked requests (one path), the ticket table and routing of
//! completions, the one blocking wait, adaptive spinning, poller threads, counters.

pub(crate) mod completion;
pub(crate) mod poller;
pub(crate) mod spin;
pub(crate) mod stats;
pub(crate) mod submit;
pub(crate) mod wait;
