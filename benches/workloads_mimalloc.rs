//! The workloads of benches/workloads with mimalloc as the process allocator.

#[global_allocator]
static A: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "workloads/mod.rs"]
mod w;

fn main() {
    w::main("mimalloc");
}
