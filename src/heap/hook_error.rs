//! Why an extent hook failed: recorded per thread inside the hook, turned into a typed error by
//! the allocating call once jemalloc returned NULL.
//!
//! A hook failure does not always fail the allocation: jemalloc falls back (a commit that could
//! not register an idle chunk again is followed by a new chunk, a failed growth by a whole chunk
//! by one of the exact size). What such a hook recorded belongs to the allocation during which it
//! ran, and only to it: the allocating call takes it whether jemalloc failed ([`take_hook_error`])
//! or not ([`discard_hook_error`]), and an owner nobody reads errors of (`Global`'s) does not
//! record at all (`hooks::hook_failed`). Otherwise a later allocation that fails without a hook's
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

#[cfg(test)]
mod tests {
    use std::alloc::Layout;

    use super::{HookError, Registering};
    use crate::heap::idle::FAIL_NEXT_COMMIT;
    use crate::heap::Heap;
    use crate::Error;

    /// The hint of a refused registration says which chunk it was: a new one, or an idle one
    /// registered again (or one registered with a PD being bound).
    #[test]
    fn a_registration_hint_names_the_chunk() {
        let hint = |what| match HookError::Register(libc::ENOMEM, what).into_error(4096) {
            Error::Registration { errno: libc::ENOMEM, hint } => hint,
            other => panic!("expected Error::Registration, got {other:?}"),
        };
        let new = hint(Registering::NewChunk);
        assert!(new.starts_with("ibv_reg_mr of a new chunk failed ("), "{new}");
        assert!(new.contains("RLIMIT_MEMLOCK"), "{new}");
        let idle = hint(Registering::IdleChunk);
        assert!(idle.starts_with("ibv_reg_mr of an idle chunk registered again ("), "{idle}");
        assert!(!idle.contains("new chunk") && idle.contains("RLIMIT_MEMLOCK"), "{idle}");
        let bind = hint(Registering::Bind);
        assert!(bind.starts_with("ibv_reg_mr of a chunk the heap already holds (binding a PD) failed ("), "{bind}");
    }

    /// A hook failure jemalloc recovered from — a commit that could not register a chunk again,
    /// followed by a chunk of its own — is not reported by a later allocation that fails for its
    /// own reason: a size above jemalloc's largest class, which it refuses without asking a hook
    /// (through the `Allocator` impl; `Heap::alloc` refuses it before).
    #[test]
    fn a_hook_failure_jemalloc_recovered_from_is_not_reported_later() {
        let heap = Heap::builder().build().unwrap();
        FAIL_NEXT_COMMIT.with(|c| c.set(libc::ENOMEM));
        let served = heap.alloc(64 << 10).expect("jemalloc falls back on an exact-size chunk");
        assert_eq!(FAIL_NEXT_COMMIT.with(|c| c.get()), 0, "the allocation went through the failing commit");
        let huge = Layout::from_size_align(isize::MAX as usize, 1).unwrap();
        match heap.raw_alloc(huge, false) {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!("expected the refused size's own OutOfMemory, got {other:?}"),
        }
        drop(served);
    }
}
