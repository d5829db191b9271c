//! The loop of benches/pair_min_{global,jemalloc}.rs: one program, built twice with only
//! `#[global_allocator]` changed, timing alloc+free pairs through `std::alloc` (what `Vec` and
//! `Box` use) — the smallest program in which the two process allocators' fast paths can be
//! compared, free of the layout effects of a large benchmark binary.

use std::alloc::Layout;
use std::hint::black_box;
use std::time::Instant;

/// The measured loop (not inlined, so that callgrind's `--toggle-collect=*measured*` finds it).
#[inline(never)]
fn measured(n: u64, layout: Layout) {
    for _ in 0..n {
        // SAFETY: a fresh allocation of `layout` (size > 0), freed once with it.
        unsafe {
            let p = std::alloc::alloc(black_box(layout));
            black_box(p);
            std::alloc::dealloc(p, layout);
        }
    }
}

/// Prints `PAIR_MIN <who> <size> <ns per pair>` for each size: 64 B, 512 B, 4 KiB.
/// `PAIR_MIN_N` sets the pairs per size (default 50 million).
pub fn run(who: &str) {
    let n: u64 = std::env::var("PAIR_MIN_N").ok().and_then(|s| s.parse().ok()).unwrap_or(50_000_000);
    for size in [64, 512, 4096] {
        let layout = Layout::from_size_align(size, 8).unwrap();
        measured(n / 100, layout); // warm-up: the thread's caches made
        let t = Instant::now();
        measured(n, layout);
        println!("PAIR_MIN {who} {size} {:.4}", t.elapsed().as_nanos() as f64 / n as f64);
    }
}
