//! `mralloc::heap::Global` as the process allocator: alloc+free pairs and batches of 1000 through
//! `std::alloc`, at the same sizes as benches/alloc.rs (whose `jemalloc` rows are the baseline).

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

#[global_allocator]
static A: mralloc::heap::Global = mralloc::heap::Global::new();

mod common;

use common::{config, label, SIZES};

fn all(c: &mut Criterion) {
    assert!(A.is_ready());
    let mut g = c.benchmark_group("pair");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        g.bench_function(BenchmarkId::new("global", label(n)), |b| {
            b.iter(|| unsafe {
                let p = alloc(black_box(layout));
                black_box(p);
                dealloc(p, layout);
            })
        });
    }
    g.finish();
    let mut g = c.benchmark_group("batch1000");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        g.bench_function(BenchmarkId::new("global", label(n)), |b| {
            let mut v = Vec::with_capacity(1000);
            b.iter(|| unsafe {
                for _ in 0..1000 {
                    v.push(alloc(layout));
                }
                for p in v.drain(..) {
                    dealloc(p, layout);
                }
            })
        });
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
