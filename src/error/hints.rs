//! What to tell the user next to an error: the likely cause of a failed verb or work
//! completion, and where to look.

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
pub(super) fn operation_hint(op: &str, status: crate::verbs::WcStatus) -> &'static str {
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

pub(super) fn hint_for(verb: &'static str, errno: i32) -> Option<String> {
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
