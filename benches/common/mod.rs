//! What the benchmarks share: sizes, labels, criterion settings (allocation), medians.
#![allow(dead_code)]

use std::time::Duration;

use criterion::Criterion;

/// The sizes every allocation benchmark measures.
pub const SIZES: [usize; 5] = [64, 512, 4096, 65536, 1 << 20];

/// `64B`, `4KiB`, `1MiB`: the labels scripts/bench-alloc reads back.
pub fn label(n: usize) -> String {
    match n {
        n if n >= 1 << 20 => format!("{}MiB", n >> 20),
        n if n >= 1 << 10 => format!("{}KiB", n >> 10),
        n => format!("{n}B"),
    }
}

/// Short runs: the whole suite stays around a minute on 2 cores.
pub fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1200))
        .sample_size(20)
}

/// The median of `v` (sorted in place; the upper middle for an even count). Panics on an empty
/// slice or a NaN.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}
