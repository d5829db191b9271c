//! The resident-memory workload shared by `rss_global` and `rss_jemalloc`: the same program with
//! a different `#[global_allocator]`, so the two RSS figures compare allocators, not programs.
//!
//! Two threads each keep a window of live `Vec<u8>`s of random sizes (16 B to 1 MiB, skewed
//! small) and replace a random one per step; then every thread drops its window and a short
//! steady phase keeps 4 MiB live. Prints the peak and the final RSS (`/proc/self/statm`).

use std::time::Duration;

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 4096
}

fn size(x: u64) -> usize {
    // 3/4 small (16 B - 4 KiB), 1/4 large (4 KiB - 1 MiB).
    if x % 4 != 0 {
        16 + (x >> 8) as usize % 4096
    } else {
        4096 + (x >> 8) as usize % (1 << 20)
    }
}

fn worker(seed: u64, steps: usize, window: usize) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut live: Vec<Vec<u8>> = (0..window).map(|_| vec![1u8; size(next())]).collect();
    for _ in 0..steps {
        let i = next() as usize % window;
        live[i] = vec![2u8; size(next())];
    }
    std::hint::black_box(&live);
}

/// Runs the workload; prints `RSS_MIB <who> peak <p> final <f>`.
pub fn run(who: &str) {
    let mut peak = 0;
    let threads: Vec<_> = (0..2u64).map(|t| std::thread::spawn(move || worker(t + 11, 200_000, 512))).collect();
    while threads.iter().any(|t| !t.is_finished()) {
        peak = peak.max(rss_bytes());
        std::thread::sleep(Duration::from_millis(5));
    }
    threads.into_iter().for_each(|t| t.join().unwrap());
    peak = peak.max(rss_bytes());
    let steady: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 64 << 10]).collect();
    // Give decay a chance, as a service would (jemalloc's default dirty decay is 10 s; purge
    // instead of waiting, identically for both allocators).
    let null = std::ptr::null_mut();
    // SAFETY: a command mallctl (no old value, no new value) on every automatic arena.
    unsafe { tikv_jemalloc_sys::mallctl(c"arena.4096.purge".as_ptr(), null, null.cast(), null, 0) };
    std::hint::black_box(&steady);
    println!("RSS_MIB {who} peak {:.1} final {:.1}", peak as f64 / 1048576.0, rss_bytes() as f64 / 1048576.0);
}
