//! Resident memory of the workload in benches/rss/workload.rs with plain jemalloc
//! (tikv-jemallocator, the same jemalloc build) as the process allocator: the baseline of
//! rss_global.

#[global_allocator]
static A: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[path = "rss/workload.rs"]
mod workload;

fn main() {
    workload::set_jemalloc_decay();
    workload::run("jemalloc");
}
