//! Allocation throughput, natively on the host (the hot path does not depend on the device:
//! registration happens once per chunk). Scoped `Heap` (unbound) vs plain jemalloc
//! (tikv-jemallocator) vs mimalloc (pairs, batches, the window) vs glibc (`std::alloc::System`): alloc+free pairs, batches, 1 and 2
//! threads, a random window of live objects, cross-thread frees; `keys_of` lookups.
//! `Global` is measured in benches/global.rs (it must be the process allocator).
//!
//! `scripts/bench-alloc` runs this and prints the ratios.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mimalloc::MiMalloc;
use mralloc::heap::Heap;
use tikv_jemallocator::Jemalloc;

mod common;

use common::{config, cross_thread, label, order, window, window_script, SIZES};

type AllocFn<'a> = Box<dyn Fn(usize) -> *mut u8 + Sync + 'a>;
type FreeFn<'a> = Box<dyn Fn(*mut u8, usize) + Sync + 'a>;

/// The three allocators under test, as (alloc, free) of a size with alignment 8.
fn pick<'a>(who: &str, heap: &'a Heap) -> (AllocFn<'a>, FreeFn<'a>) {
    let l = |n| Layout::from_size_align(n, 8).unwrap();
    match who {
        "heap" => (
            Box::new(move |n| heap.allocate(l(n)).unwrap().as_ptr().cast()),
            // SAFETY: p came from heap.allocate(l(n)).
            Box::new(move |p, n| unsafe { heap.deallocate(std::ptr::NonNull::new_unchecked(p), l(n)) }),
        ),
        // SAFETY (both): p came from alloc(l(n)) of the same allocator.
        "jemalloc" => (
            Box::new(move |n| unsafe { Jemalloc.alloc(l(n)) }),
            Box::new(move |p, n| unsafe { Jemalloc.dealloc(p, l(n)) }),
        ),
        // SAFETY (both): as above.
        "mimalloc" => (
            Box::new(move |n| unsafe { MiMalloc.alloc(l(n)) }),
            Box::new(move |p, n| unsafe { MiMalloc.dealloc(p, l(n)) }),
        ),
        _ => {
            (Box::new(move |n| unsafe { System.alloc(l(n)) }), Box::new(move |p, n| unsafe { System.dealloc(p, l(n)) }))
        }
    }
}

/// The window workload and cross-thread frees (see benches/common), for each allocator.
fn mixed(c: &mut Criterion, heap: &Heap) {
    let script = window_script(1 << 16);
    let mut g = c.benchmark_group("window");
    for who in order(vec!["heap", "jemalloc", "mimalloc", "glibc"]) {
        let (alloc, free) = pick(who, heap);
        g.bench_function(who, |b| b.iter_custom(|iters| window(iters, &script, &alloc, &free)));
    }
    g.finish();
    let mut g = c.benchmark_group("xthread");
    for n in [64, 4096, 65536] {
        for who in order(vec!["heap", "jemalloc", "glibc"]) {
            let (alloc, free) = pick(who, heap);
            g.bench_function(BenchmarkId::new(who, label(n)), |b| {
                b.iter_custom(|iters| cross_thread(iters, n, &alloc, &free))
            });
        }
    }
    g.finish();
}

/// One alloc+free pair through a GlobalAlloc-like pair of closures.
fn pairs(c: &mut Criterion, heap: &Heap) {
    let heap = &heap;
    let mut g = c.benchmark_group("pair");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        // Raw allocate/deallocate through the Allocator API, like the GlobalAlloc baselines
        // (Heap::alloc also zero-fills its Buffer).
        for who in order(vec!["heap", "jemalloc", "mimalloc", "glibc"]) {
            let id = BenchmarkId::new(who, label(n));
            match who {
                "heap" => g.bench_function(id, |b| {
                    b.iter(|| unsafe {
                        let p = heap.allocate(black_box(layout)).unwrap();
                        black_box(p);
                        heap.deallocate(p.cast(), layout);
                    })
                }),
                "jemalloc" => g.bench_function(id, |b| {
                    b.iter(|| unsafe {
                        let p = Jemalloc.alloc(black_box(layout));
                        black_box(p);
                        Jemalloc.dealloc(p, layout);
                    })
                }),
                "mimalloc" => g.bench_function(id, |b| {
                    b.iter(|| unsafe {
                        let p = MiMalloc.alloc(black_box(layout));
                        black_box(p);
                        MiMalloc.dealloc(p, layout);
                    })
                }),
                _ => g.bench_function(id, |b| {
                    b.iter(|| unsafe {
                        let p = System.alloc(black_box(layout));
                        black_box(p);
                        System.dealloc(p, layout);
                    })
                }),
            };
        }
    }
    g.finish();
}

/// 1000 allocations, then 1000 frees.
fn batches(c: &mut Criterion, heap: &Heap) {
    let heap = &heap;
    let mut g = c.benchmark_group("batch1000");
    for n in SIZES {
        let layout = Layout::from_size_align(n, 8).unwrap();
        for who in order(vec!["heap", "jemalloc", "mimalloc", "glibc"]) {
            let id = BenchmarkId::new(who, label(n));
            let mut v = Vec::with_capacity(1000);
            if who == "heap" {
                g.bench_function(id, |b| {
                    b.iter(|| unsafe {
                        for _ in 0..1000 {
                            v.push(heap.allocate(layout).unwrap());
                        }
                        for p in v.drain(..) {
                            heap.deallocate(p.cast(), layout);
                        }
                    })
                });
            } else {
                let a: &dyn GlobalAlloc = match who {
                    "jemalloc" => &Jemalloc,
                    "mimalloc" => &MiMalloc,
                    _ => &System,
                };
                let mut v = Vec::with_capacity(1000);
                g.bench_function(id, |b| {
                    b.iter(|| unsafe {
                        for _ in 0..1000 {
                            v.push(a.alloc(layout));
                        }
                        for p in v.drain(..) {
                            a.dealloc(p, layout);
                        }
                    })
                });
            }
        }
    }
    g.finish();
}

/// Throughput of `threads` threads each doing `iters` 64-byte pairs; reports time per pair per
/// thread (so perfect scaling keeps it constant).
fn threaded(c: &mut Criterion, heap: &Heap) {
    let heap = &heap;
    let mut g = c.benchmark_group("threads64B");
    for threads in [1usize, 2] {
        g.bench_function(BenchmarkId::new("heap", threads), |b| {
            let layout = Layout::from_size_align(64, 8).unwrap();
            b.iter_custom(|iters| {
                run_threads(threads, iters, || unsafe {
                    let p = heap.allocate(layout).unwrap();
                    heap.deallocate(black_box(p).cast(), layout);
                })
            })
        });
        g.bench_function(BenchmarkId::new("jemalloc", threads), |b| {
            let layout = Layout::from_size_align(64, 8).unwrap();
            b.iter_custom(|iters| {
                run_threads(threads, iters, || unsafe {
                    let p = Jemalloc.alloc(layout);
                    Jemalloc.dealloc(black_box(p), layout);
                })
            })
        });
    }
    g.finish();
}

fn run_threads(threads: usize, iters: u64, f: impl Fn() + Sync) -> Duration {
    let barrier = std::sync::Barrier::new(threads);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    f(); // create this thread's cache outside the timing
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..iters {
                        f();
                    }
                    t.elapsed()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

fn lookups(c: &mut Criterion, heap: &Heap) {
    let bufs: Vec<_> = (0..1024).map(|i| heap.alloc(64 + i * 97).unwrap()).collect();
    let ptrs: Vec<*const u8> = bufs.iter().map(|b| b.as_ptr()).collect();
    let mut g = c.benchmark_group("lookup");
    g.bench_function("keys_of_unbound", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) & 1023;
            black_box(mralloc::keys_of(black_box(ptrs[i])))
        })
    });
    g.finish();
}

fn all(c: &mut Criterion) {
    let heap = Heap::builder().build().unwrap();
    pairs(c, &heap);
    batches(c, &heap);
    threaded(c, &heap);
    mixed(c, &heap);
    lookups(c, &heap);
}

criterion_group! { name = benches; config = config(); targets = all }
criterion_main!(benches);
