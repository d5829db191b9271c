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
