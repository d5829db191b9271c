//! The workloads of benches/workloads (json, strings, threads) with `mralloc::heap::Global`
//! (unbound) as the process allocator. `scripts/bench-alloc` compares it with workloads_jemalloc,
//! workloads_mimalloc and workloads_glibc.

#[global_allocator]
static A: mralloc::heap::Global = mralloc::heap::Global::new();

#[path = "workloads/mod.rs"]
mod w;

fn main() {
    // std allocated before main: the hooks are installed, every allocation below is Global's.
    assert!(A.is_ready());
    w::main("global");
}
