//! Why an extent hook failed: recorded per thread inside the hook, turned into a typed error by
//! the allocating call once jemalloc returned NULL.
//!
//! A hook failure does not always fail the allocation: jemalloc falls back (a commit that could
//! not register an idle chunk again is followed by a new chunk, a failed growth by a whole chunk
//! by one of the exact size). What such a hook recorded belongs to the allocation during which it
//! ran, and only to it: the allocating call takes it whether jemalloc failed ([`take_hook_error`])
//! or not ([`discard_hook_error`]), and an owner nobody reads errors of (`Global`'s) does not
//! record at all (`hook_failed`). Otherwise a later allocation that fails without a hook's
//! reason (jemalloc refusing a size by itself) would report it.

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
    Register(i32, Registering),
    // `madvise` of the chunk's fork advice failed (`MADV_DONTFORK`, or `MADV_DOFORK` after
    // registering: `chunk::advise`, `chunk::keep_in_children`).
    Advise(i32),
    TableFull,
}

/// Which registration of a chunk `ibv_reg_mr` refused (the hint says which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Registering {
    /// A chunk being mapped (the alloc hook).
    NewChunk,
    /// A chunk released as idle, registered again as jemalloc uses it again (the commit hook).
    IdleChunk,
    /// A chunk the heap already held, with a PD being bound (`HeapBuilder::bind`, `Heap::bind`).
    Bind,
}

impl Registering {
    /// The chunk, as the hint names it.
    fn chunk(self) -> &'static str {
        match self {
            Registering::NewChunk => "a new chunk",
            Registering::IdleChunk => {
                "an idle chunk registered again (released after the idle interval, now used again)"
            }
            Registering::Bind => "a chunk the heap already holds (binding a PD)",
        }
    }
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

/// After jemalloc served an allocation: drops what a hook recorded on the way (a failure jemalloc
/// recovered from), so that no later allocation reports it. On the allocation path: a load, and a
/// store only when a hook did fail.
#[inline(always)]
pub(crate) fn discard_hook_error() {
    if HOOK_ERROR.try_with(|c| !matches!(c.get(), HookError::None)).unwrap_or(false) {
        take_hook_error();
    }
}

impl HookError {
    /// The typed error for a failed allocation of `requested` bytes.
    pub(crate) fn into_error(self, requested: usize) -> Error {
        match self {
            HookError::Limit { limit, mapped, requested: chunk } => {
                Error::LimitExceeded { limit, mapped, requested: requested.max(chunk) }
            }
            HookError::Register(errno, what) => Error::Registration {
                errno,
                hint: format!(
                    "ibv_reg_mr of {} failed ({}); registered memory is pinned: {}",
                    what.chunk(),
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

/// Records why a hook of an owner (`is_static`: the global allocator's) failed for `size` bytes: in this thread's hook error, which the
/// allocating call takes (`heap::hook_error`). The global allocator's callers do not look for the
/// reason (its fast path is jemalloc's), so its owner reports here instead, once per failure,
/// and leaves nothing behind that a scoped heap's allocation on this thread could report as its own.
pub(crate) fn hook_failed(is_static: bool, size: usize, e: HookError) {
    #[cfg(feature = "global")]
    if is_static {
        report_chunk_failure(size, e);
        return;
    }
    let _ = (is_static, size);
    set_hook_error(e);
}

/// Reports a failed chunk allocation or commit of the global allocator's hooks (called by
/// [`hook_failed`] for the static owner, instead of leaving the reason in the thread-local for a
/// caller: the allocation fast path does not look at what jemalloc returns). Writes one line to stderr
/// without allocating. jemalloc may still serve the request: after a failed growth by a
/// whole chunk it retries once with the exact size.
#[cfg(feature = "global")]
#[cold]
fn report_chunk_failure(size: usize, e: HookError) {
    let why = match e {
        HookError::None => return,
        HookError::Register(_, Registering::IdleChunk) => {
            "ibv_reg_mr refused an idle chunk registered again; check RLIMIT_MEMLOCK (ulimit -l)"
        }
        HookError::Register(..) => "ibv_reg_mr refused a new chunk; check RLIMIT_MEMLOCK (ulimit -l)",
        HookError::Limit { .. } => "heap limit reached",
        HookError::Map(_) => "mmap of a new chunk failed",
        HookError::Numa(_) => "mbind of a new chunk failed",
        HookError::Advise(_) => "madvise (fork advice) of a chunk failed",
        HookError::TableFull => "chunk table full",
    };
    // Inside the allocator: no typed Error here; a caller whose allocation fails sees NULL and
    // Rust's alloc-error path follows (jemalloc may still serve it from another chunk).
    crate::os::stderr_line(format_args!("mralloc::Global: a chunk of {size} bytes failed: {e:?} ({why})"));
}
