//! Resident memory of the workload in benches/rss/workload.rs with `mralloc::heap::Global`
//! (unbound, idle interval [`workload::IDLE`]) as the process allocator. `scripts/bench-alloc` compares it with rss_jemalloc.

#[global_allocator]
static A: mralloc::heap::Global = mralloc::heap::Global::new().idle_release(Some(workload::IDLE));

#[path = "rss/workload.rs"]
mod workload;

/// With `MRALLOC_RSS_BIND` set (scripts/bench-alloc's VM part), `Global` is bound to the
/// default device first: every chunk registered, released when idle.
fn main() {
    let _pd = std::env::var_os("MRALLOC_RSS_BIND").map(|_| {
        let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default().expect("an RDMA device")).unwrap();
        A.bind(&pd).expect("Global binds");
        pd
    });
    workload::run(if _pd.is_some() { "global_bound" } else { "global" });
    if _pd.is_some() {
        eprintln!("rss_global (bound): {:?}", A.stats());
    }
}
