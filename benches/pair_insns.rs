//! Instructions per alloc+free pair, for `scripts/bench-alloc`'s profile (issue: the allocator's
//! fast path at the floor). Not a criterion bench: `scripts/bench-alloc` runs it under valgrind's
//! callgrind (`--toggle-collect` on the measured loop only) once per allocator and size, and
//! divides the instruction count by the number of pairs. Instruction counts, unlike times, do
//! not depend on what else the machine is doing.
//!
//!     pair_insns <heap|jemalloc|glibc|mimalloc> <size> <pairs>

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;

use allocator_api2::alloc::Allocator;
use mralloc::heap::Heap;
use tikv_jemallocator::Jemalloc;

/// The measured loop (callgrind collects inside this function only; never inlined so that
/// `--toggle-collect=pair_insns::measured*` finds it).
#[inline(never)]
fn measured(pairs: u64, mut pair: impl FnMut()) {
    for _ in 0..pairs {
        pair();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` runs every bench binary with `--bench`: nothing to do then.
    if args.iter().any(|a| a == "--bench") || args.is_empty() {
        return;
    }
    let (who, size, pairs) = match &args[..] {
        [w, s, p] => (w.as_str(), s.parse::<usize>().expect("size"), p.parse::<u64>().expect("pairs")),
        _ => {
            eprintln!("usage: pair_insns <heap|jemalloc|glibc|mimalloc> <size> <pairs>");
            std::process::exit(2);
        }
    };
    let layout = Layout::from_size_align(size, 8).expect("layout");
    let heap = Heap::builder().build().expect("a scoped heap");
    // Warm-up outside the measured loop: thread caches, the first chunk, the front's magazines.
    let warm = |f: &mut dyn FnMut()| (0..10_000).for_each(|_| f());
    // SAFETY (all arms): each pair frees exactly the block it allocated, with its layout.
    let mut heap_pair = || unsafe {
        let p = heap.allocate(black_box(layout)).expect("heap allocation");
        heap.deallocate(black_box(p).cast(), layout);
    };
    let mut je_pair = || unsafe {
        let p = Jemalloc.alloc(black_box(layout));
        Jemalloc.dealloc(black_box(p), layout);
    };
    let mut glibc_pair = || unsafe {
        let p = System.alloc(black_box(layout));
        System.dealloc(black_box(p), layout);
    };
    let mut mi_pair = || unsafe {
        let p = mimalloc::MiMalloc.alloc(black_box(layout));
        mimalloc::MiMalloc.dealloc(black_box(p), layout);
    };
    let pair: &mut dyn FnMut() = match who {
        "heap" => &mut heap_pair,
        "jemalloc" => &mut je_pair,
        "glibc" => &mut glibc_pair,
        "mimalloc" => &mut mi_pair,
        other => {
            eprintln!("pair_insns: unknown allocator {other}");
            std::process::exit(2);
        }
    };
    warm(pair);
    measured(pairs, pair);
}
