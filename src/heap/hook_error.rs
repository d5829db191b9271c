//! Why an extent hook failed: recorded per thread inside the hook, turned into a typed error by
//! the allocating call once jemalloc returned NULL.

use std::cell::Cell;

use crate::error::{memlock_text, Error};

/// Why the last extent-hook call on this thread failed. Read by the allocating call after
/// jemalloc returned NULL, to turn it into a typed error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HookError {
    None,
    Limit { limit: usize, mapped: usize, requested: usize },
    Map(i32),
    Numa(i32),
    Register(i32),
    // `madvise` of the chunk's fork advice failed (`MADV_DONTFORK`, or `MADV_DOFORK` after
    // registering: `chunk::advise`, `chunk::keep_in_children`).
    Advise(i32),
    TableFull,
}

thread_local! {
    static HOOK_ERROR: Cell<HookError> = const { Cell::new(HookError::None) };
}

pub(crate) fn set_hook_error(e: HookError) {
    let _ = HOOK_ERROR.try_with(|c| c.set(e));
}

/// Takes (and clears) this thread's last hook error.
pub(crate) fn take_hook_error() -> HookError {
    HOOK_ERROR.try_with(|c| c.replace(HookError::None)).unwrap_or(HookError::None)
}

impl HookError {
    /// The typed error for a failed allocation of `requested` bytes.
    pub(crate) fn into_error(self, requested: usize) -> Error {
        match self {
            HookError::Limit { limit, mapped, requested: chunk } => {
                Error::LimitExceeded { limit, mapped, requested: requested.max(chunk) }
            }
            HookError::Register(errno) => Error::Registration {
                errno,
                hint: format!(
                    "ibv_reg_mr of a new chunk failed ({}); registered memory is pinned: {}",
                    std::io::Error::from_raw_os_error(errno),
                    memlock_text()
                ),
            },
            HookError::Map(errno) => Error::Io {
                what: format!("mapping a chunk for a {requested}-byte allocation"),
                source: std::io::Error::from_raw_os_error(errno),
            },
            HookError::Numa(errno) => Error::Io {
                what: "binding a chunk to its NUMA node (mbind)".into(),
                source: std::io::Error::from_raw_os_error(errno),
            },
            HookError::Advise(errno) => Error::Io {
                what: "giving a chunk its fork() advice (madvise MADV_DONTFORK / MADV_DOFORK)".into(),
                source: std::io::Error::from_raw_os_error(errno),
            },
            HookError::TableFull => Error::OutOfMemory { requested, why: "the chunk table is full" },
            HookError::None => Error::OutOfMemory { requested, why: "jemalloc returned no memory" },
        }
    }
}
