//! tikv-jemallocator as the process allocator, measured through `std::alloc` exactly as
//! benches/global.rs measures `mralloc::heap::Global`: the same program with only
//! `#[global_allocator]` changed. Both then pay Rust's allocator dispatch (`std::alloc::alloc`
//! → `__rust_alloc` → the allocator), which benches/global.rs's in-process baselines, called as
//! values, do not: `scripts/bench-alloc` prints `global_vs_jemalloc_as_global_*` (Global against
//! this) next to `global_vs_jemalloc_*` (Global against jemalloc called as a value), and
//! `jemalloc_dispatch_*` (this against jemalloc called as a value: what the dispatch costs).

use std::alloc::{GlobalAlloc, Layout};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tikv_jemallocator::Jemalloc;

#[global_allocator]
static A: Jemalloc = Jemalloc;

mod common;

use common::{batch, config, label, pair, window, window_script, ProcessAlloc, SIZES};

fn all(c: &mut Criterion) {
    let name = "jemalloc_as_global";
    let mut g = c.benchmark_group("pair");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        g.bench_function(BenchmarkId::new(name, label(n)), |b| b.iter(|| pair(&ProcessAlloc, layout)));
    }
    g.finish();
    let mut g = c.benchmark_group("batch1000");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        let mut v = Vec::with_capacity(1000);
        g.bench_function(BenchmarkId::new(name, label(n)), |b| b.iter(|| batch(&ProcessAlloc, layout, &mut v)));
    }
    g.finish();
    let script = window_script(1 << 16);
    let mut g = c.benchmark_group("window");
    // Called as benches/global.rs calls it (a `dyn GlobalAlloc`).
    let a: &(dyn GlobalAlloc + Sync) = &ProcessAlloc;
    // SAFETY (both closures): p came from a.alloc of the same layout.
    let alloc = |n| unsafe { a.alloc(Layout::from_size_align_unchecked(n, 8)) };
    let free = |p, n| unsafe { a.dealloc(p, Layout::from_size_align_unchecked(n, 8)) };
    g.bench_function(name, |b| b.iter_custom(|iters| window(iters, &script, alloc, free)));
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = all }
criterion_main!(benches);
