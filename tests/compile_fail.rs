//! The ownership rules, as programs that must not compile (pinned compiler messages in
//! `tests/compile_fail/*.stderr`). Non-blocking operations and grants take owned buffers: a
//! borrow can be ended by `mem::forget` while the NIC still uses the memory, so none qualifies.
//!
//! Host-only (it runs cargo); re-pin after a toolchain change with `TRYBUILD=overwrite`.

#[test]
fn ownership_rules_are_enforced_at_compile_time() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile_fail/*.rs");
}

/// The async operations (feature `tokio`) take owned buffers too: dropping their future must not
/// end a borrow the NIC still uses.
#[cfg(feature = "tokio")]
#[test]
fn async_operations_take_owned_buffers() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile_fail_async/*.rs");
}
