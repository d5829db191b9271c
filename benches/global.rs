//! `mralloc::heap::Global` as the process allocator: alloc+free pairs and batches of 1000 through
//! `std::alloc`, at the same sizes as benches/alloc.rs, each next to plain jemalloc
//! (tikv-jemallocator) and mimalloc in the same process: the baselines of the `global_vs_jemalloc`
//! and `global_vs_mimalloc` ratios. Also the random window and cross-thread frees of benches/common.

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

#[global_allocator]
static A: mralloc::heap::Global = mralloc::heap::Global::new();

mod common;

use common::{batch, config, cross_thread, label, order, pair, window, window_script, ProcessAlloc, SIZES};
use mimalloc::MiMalloc;
use tikv_jemallocator::Jemalloc;

fn all(c: &mut Criterion) {
    assert!(A.is_ready());
    // Global (through std::alloc, as a program uses it) and plain jemalloc in the same process,
    // back to back per size; scripts/bench-alloc alternates their order between rounds.
    let who: Vec<(&str, &(dyn GlobalAlloc + Sync))> = order(vec![
        ("global", &ProcessAlloc),
        ("jemalloc_beside_global", &Jemalloc),
        ("mimalloc_beside_global", &MiMalloc),
    ]);
    let mut g = c.benchmark_group("pair");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        for &(name, a) in &who {
            g.bench_function(BenchmarkId::new(name, label(n)), |b| b.iter(|| pair(a, layout)));
        }
    }
    g.finish();
    let mut g = c.benchmark_group("batch1000");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        for &(name, a) in &who {
            let mut v = Vec::with_capacity(1000);
            g.bench_function(BenchmarkId::new(name, label(n)), |b| b.iter(|| batch(a, layout, &mut v)));
        }
    }
    g.finish();
    // The window workload and cross-thread frees (benches/common).
    let script = window_script(1 << 16);
    let mut g = c.benchmark_group("window");
    for &(name, a) in &who {
        // SAFETY (both closures): p came from a.alloc of the same layout.
        let alloc = |n| unsafe { a.alloc(Layout::from_size_align_unchecked(n, 8)) };
        let free = |p, n| unsafe { a.dealloc(p, Layout::from_size_align_unchecked(n, 8)) };
        g.bench_function(name, |b| b.iter_custom(|iters| window(iters, &script, alloc, free)));
    }
    g.finish();
    let mut g = c.benchmark_group("xthread");
    for n in [64, 4096, 65536] {
        for &(name, a) in &who {
            // SAFETY: as above.
            let alloc = |n| unsafe { a.alloc(Layout::from_size_align_unchecked(n, 8)) };
            let free = |p, n| unsafe { a.dealloc(p, Layout::from_size_align_unchecked(n, 8)) };
            g.bench_function(BenchmarkId::new(name, label(n)), |b| {
                b.iter_custom(|iters| cross_thread(iters, n, alloc, free))
            });
        }
    }
    g.finish();
    // The lookup against the global heap (every pointer of the process is in a chunk).
    let bufs: Vec<Vec<u8>> = (0..1024).map(|i| vec![0u8; 64 + i * 97]).collect();
    let mut g = c.benchmark_group("lookup");
    g.bench_function("keys_of_global_unbound", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) & 1023;
            black_box(mralloc::keys_of(black_box(bufs[i].as_ptr())))
        })
    });
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = all }
criterion_main!(benches);
