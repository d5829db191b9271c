//! Hook errors: the registration hint's text, and a failure jemalloc recovered from reported
//! by no later allocation. (A leaf module: it reaches into `idle` and `Heap`, which
//! `hook_error` itself must not.)

use std::alloc::Layout;

use crate::heap::hook_error::{HookError, Registering};
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
