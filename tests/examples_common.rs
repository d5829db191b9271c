//! The examples' shared helpers (examples/common) with their unit tests: `cargo test` only builds
//! the examples, so their tests run here.

#[path = "../examples/common/mod.rs"]
mod common;
