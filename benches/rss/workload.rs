//! The resident-memory workload shared by `rss_global` and `rss_jemalloc`: the same program with
//! a different `#[global_allocator]`, so the two RSS figures compare allocators, not programs.
//!
//! Two threads each keep a window of live `Vec<u8>`s of random sizes (16 B to 1 MiB, skewed
//! small) and replace a random one per step; then every thread drops its window and a short
//! steady phase keeps 4 MiB live. Each thread then keeps running light work (small allocations,
//! as a service between bursts would) for [`IDLE`] and a half, calling nothing that purges: the
//! RSS then (`idle`) is what the allocators' own idle policies give back — mralloc's
//! `Global::idle_release` and jemalloc's `dirty_decay_ms`, both set to [`IDLE`]. Prints the
//! peak, the idle and the final RSS (after an explicit purge; `/proc/self/statm`).

use std::time::{Duration, Instant};

/// The idle interval both allocators are given (rss_global's `Global::idle_release`, and
/// `dirty_decay_ms` of every arena in rss_jemalloc: [`set_jemalloc_decay`]).
pub const IDLE: Duration = Duration::from_secs(2);

/// Sets `dirty_decay_ms` of every automatic arena (and of arenas made later) to [`IDLE`]: plain
/// jemalloc's idle policy, for rss_jemalloc.
#[allow(dead_code)] // rss_global uses Global's own setting
pub fn set_jemalloc_decay() {
    let ms = IDLE.as_millis() as isize;
    // SAFETY: `dirty_decay_ms` mallctls take an ssize_t; an arena not initialised yet fails
    // (EFAULT) and takes the `arenas.` default when it is.
    unsafe {
        tikv_jemalloc_ctl::raw::write(b"arenas.dirty_decay_ms\0", ms).unwrap();
        let narenas: u32 = tikv_jemalloc_ctl::raw::read(b"opt.narenas\0").unwrap();
        for i in 0..narenas {
            let _ = tikv_jemalloc_ctl::raw::write(format!("arena.{i}.dirty_decay_ms\0").as_bytes(), ms);
        }
    }
}

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
    drop(live);
    // Idle: light work only, for the idle interval and a half (it also runs the allocator's
    // deferred work, as in any service: jemalloc decays as a side effect of allocations).
    let t = Instant::now();
    while t.elapsed() < IDLE + IDLE / 2 {
        for i in 0..200 {
            std::hint::black_box(vec![i as u8; 64 + i]);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs the workload; prints `RSS_MIB <who> peak <p> idle <i> final <f>`.
pub fn run(who: &str) {
    let mut peak = 0;
    // MRALLOC_RSS_STEPS: fewer steps under TCG (scripts/bench-alloc's VM part).
    let steps = std::env::var("MRALLOC_RSS_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let threads: Vec<_> = (0..2u64).map(|t| std::thread::spawn(move || worker(t + 11, steps, 512))).collect();
    while threads.iter().any(|t| !t.is_finished()) {
        peak = peak.max(rss_bytes());
        std::thread::sleep(Duration::from_millis(5));
    }
    threads.into_iter().for_each(|t| t.join().unwrap());
    let idle = rss_bytes();
    peak = peak.max(idle);
    let steady: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 64 << 10]).collect();
    // Then everything free given back at once, identically for both allocators (an explicit
    // purge: with mralloc's idle release on, it releases idle chunks too).
    let null = std::ptr::null_mut();
    // SAFETY: a command mallctl (no old value, no new value) on every automatic arena.
    unsafe { tikv_jemalloc_sys::mallctl(c"arena.4096.purge".as_ptr(), null, null.cast(), null, 0) };
    std::hint::black_box(&steady);
    println!(
        "RSS_MIB {who} peak {:.1} idle {:.1} final {:.1}",
        peak as f64 / 1048576.0,
        idle as f64 / 1048576.0,
        rss_bytes() as f64 / 1048576.0
    );
}
