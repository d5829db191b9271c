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

/// `v` as given, or reversed when `MRALLOC_BENCH_REVERSE` is set (scripts/bench-alloc alternates
/// the order in which mralloc and its baselines run between rounds).
pub fn order<T>(mut v: Vec<T>) -> Vec<T> {
    if std::env::var_os("MRALLOC_BENCH_REVERSE").is_some() {
        v.reverse();
    }
    v
}

/// Short runs: the whole suite stays around a minute on 2 cores. No plots: criterion would run
/// gnuplot in the background while the next benchmark measures.
pub fn config() -> Criterion {
    Criterion::default()
        .without_plots()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1200))
        .sample_size(20)
}

/// The median of `v` (sorted in place; the mean of the two middle values for an even count, as
/// scripts/lib.sh `spread`). Panics on an empty slice or a NaN.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Latency statistics computed as perftest's `print_report_lat` does, from the instants at which
/// each iteration's first work request was posted: one sample per interval between consecutive
/// posts (so a sample includes everything the loop does: the wait for the peer, reaping the own
/// completion, re-posting the receive), sorted, the two largest dropped, each divided by
/// `rtt_factor` (2 for ping-pong tests, 1 for READ). Returns (typical = perftest's median, p99)
/// in µs. Panics with fewer than 4 posts.
pub fn perftest_latency(posted: &[std::time::Instant], rtt_factor: f64) -> (f64, f64) {
    assert!(posted.len() >= 4, "need at least 4 iterations");
    let mut delta: Vec<f64> = posted.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e6 / rtt_factor).collect();
    delta.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let n = delta.len() - 2; // LAT_MEASURE_TAIL
    let typical = if (n - 1) % 2 == 1 { (delta[n / 2] + delta[n / 2 - 1]) / 2.0 } else { delta[n / 2] };
    let p99 = delta[((n as f64) * 0.99).ceil() as usize];
    (typical, p99)
}
