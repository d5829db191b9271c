//! Instructions per alloc+free pair, for `scripts/bench-alloc`'s profile (issue: the allocator's
//! fast path at the floor). Not a criterion bench: `scripts/bench-alloc` runs it under valgrind's
//! callgrind (`--toggle-collect` on the measured loop only) once per allocator and size, and
//! divides the instruction count by the number of objects. Instruction counts, unlike times, do
//! not depend on what else the machine is doing.
//!
//!     pair_insns <heap|buffer|global|jemalloc|glibc|mimalloc> <size> <objects> [pair|batch]
//!
//! `buffer` is a scoped heap's own `Buffer` path (`Heap::alloc_uninit`, then the buffer's drop,
//! which frees through the heap record the buffer carries rather than a handle), pairs only.
//!
//! `global` (with feature `global`) is `mralloc::heap::Global` called as a value, as
//! tikv-jemallocator's `Jemalloc` is for `jemalloc`: both inline into the loop the same way, so
//! the two differ by exactly what Global adds to jemalloc's path. As a `#[global_allocator]`, both
//! would sit behind the same `__rust_alloc` shim. Its first call installs the hooks on jemalloc's
//! automatic arenas (what makes it ready; being the process allocator only makes that call come
//! earlier), so the measured loop runs on hooked arenas, as in a program.
//!
//! `pair` (the default) allocates and frees one object at a time; `batch` allocates 1000
//! objects, then frees them in the same order (as benches/alloc.rs's `batch1000`), `objects`
//! / 1000 times.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;

use allocator_api2::alloc::Allocator;
use mralloc::heap::Heap;
use tikv_jemallocator::Jemalloc;

/// Not the process allocator: called as a value (see the module docs).
#[cfg(feature = "global")]
static GLOBAL: mralloc::heap::Global = mralloc::heap::Global::new();

/// Objects live at once in `batch` mode.
const BATCH: usize = 1000;

/// The measured loop (callgrind collects inside this function only; never inlined so that
/// `--toggle-collect=pair_insns::measured*` finds it).
#[inline(never)]
fn measured(rounds: u64, mut round: impl FnMut()) {
    for _ in 0..rounds {
        round();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` runs every bench binary with `--bench`: nothing to do then.
    if args.iter().any(|a| a == "--bench") || args.is_empty() {
        return;
    }
    let usage = || -> ! {
        eprintln!("usage: pair_insns <heap|buffer|global|jemalloc|glibc|mimalloc> <size> <objects> [pair|batch]");
        std::process::exit(2);
    };
    let (who, size, objects, batch) = match &args[..] {
        [w, s, p] => (w.as_str(), s, p, false),
        [w, s, p, m] if m == "pair" || m == "batch" => (w.as_str(), s, p, m == "batch"),
        _ => usage(),
    };
    let (size, objects) = (size.parse::<usize>().expect("size"), objects.parse::<u64>().expect("objects"));
    let layout = Layout::from_size_align(size, 8).expect("layout");
    // SAFETY (every arm): `free` gets a block `alloc` returned, with its layout, once; the
    // layouts have a non-zero size.
    unsafe {
        match who {
            "heap" => {
                // Built only when measured (a scoped heap creates an arena of its own).
                let heap = Heap::builder().build().expect("a scoped heap");
                run(
                    || heap.allocate(black_box(layout)).expect("heap allocation").as_ptr().cast(),
                    |p| heap.deallocate(std::ptr::NonNull::new_unchecked(p), layout),
                    objects,
                    batch,
                )
            }
            "buffer" if !batch => {
                let heap = Heap::builder().build().expect("a scoped heap");
                let pair = || drop(black_box(heap.alloc_uninit(black_box(size)).expect("heap buffer")));
                (0..10_000).for_each(|_| pair());
                measured(objects, pair);
            }
            #[cfg(feature = "global")]
            "global" => {
                let pair = |p: *mut u8| GLOBAL.dealloc(p, layout);
                run(|| GLOBAL.alloc(black_box(layout)), pair, objects, batch);
                assert!(GLOBAL.is_ready(), "Global installed its hooks");
            }
            "jemalloc" => run(|| Jemalloc.alloc(black_box(layout)), |p| Jemalloc.dealloc(p, layout), objects, batch),
            "glibc" => run(|| System.alloc(black_box(layout)), |p| System.dealloc(p, layout), objects, batch),
            "mimalloc" => run(
                || mimalloc::MiMalloc.alloc(black_box(layout)),
                |p| mimalloc::MiMalloc.dealloc(p, layout),
                objects,
                batch,
            ),
            other => {
                eprintln!("pair_insns: unknown allocator {other}");
                std::process::exit(2);
            }
        }
    }
}

/// Warms up, then runs the measured loop: `objects` pairs, or `objects / BATCH` batches.
///
/// # Safety
/// `free` takes any block `alloc` returned (once).
unsafe fn run(alloc: impl Fn() -> *mut u8, free: impl Fn(*mut u8), objects: u64, batch: bool) {
    // Warm-up outside the measured loop: thread caches, the first chunk, the front's magazines.
    if batch {
        let mut live = Vec::with_capacity(BATCH);
        let mut round = || {
            for _ in 0..BATCH {
                live.push(black_box(alloc()));
            }
            for p in live.drain(..) {
                free(p);
            }
        };
        (0..10).for_each(|_| round());
        measured(objects / BATCH as u64, round);
    } else {
        let pair = || free(black_box(alloc()));
        (0..10_000).for_each(|_| pair());
        measured(objects, pair);
    }
}
