//! The workloads of benches/workloads with plain jemalloc (tikv-jemallocator, the same jemalloc
//! build as mralloc's, with its default options) as the process allocator: the baseline of
//! workloads_global.

#[global_allocator]
static A: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[path = "workloads/mod.rs"]
mod w;

fn main() {
    w::main("jemalloc");
}
