//! benches/pair_min/run.rs with tikv-jemallocator as the process allocator.

#[global_allocator]
static A: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[path = "pair_min/run.rs"]
mod run;

fn main() {
    run::run("jemalloc");
}
