//! Resident memory of the workload in benches/rss/workload.rs with `mralloc::heap::Global`
//! (unbound) as the process allocator. `scripts/bench-alloc` compares it with rss_jemalloc.

#[global_allocator]
static A: mralloc::heap::Global = mralloc::heap::Global::new();

#[path = "rss/workload.rs"]
mod workload;

fn main() {
    workload::run("global");
}
