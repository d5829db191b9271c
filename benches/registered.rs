//! Registration cost on a real device (run in the VM by `scripts/bench-alloc`, in one boot):
//! a `Heap` bound to the device against the naive way — malloc + `ibv_reg_mr` + `ibv_dereg_mr` +
//! free per buffer — at 4 KiB and 64 KiB, and the cost of the first touch of a new chunk.
//! Prints `RATIO` lines; numbers are measured, never typed in.

use std::hint::black_box;
use std::time::{Duration, Instant};

use mralloc::heap::Heap;
use mralloc::verbs::{Access, Context, Mr, Pd};

fn per_op(iters: u32, mut f: impl FnMut()) -> Duration {
    f(); // warm up
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed() / iters
}

fn main() -> mralloc::Result<()> {
    if std::env::args().any(|a| a == "--bench" || a == "--list") && std::env::var("MRALLOC_DEVICE").is_err() {
        // `cargo bench` on a host without a device: nothing to measure here (see scripts/bench-alloc).
        println!("registered: needs an RDMA device; run scripts/bench-alloc");
        return Ok(());
    }
    let ctx = Context::open_default()?;
    let pd = Pd::new(&ctx)?;
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE).build()?;
    println!("device {}", ctx.name());
    for (n, label) in [(4096usize, "4KiB"), (65536, "64KiB")] {
        // Raw allocation through the Allocator API (like malloc below: no zero-fill), one byte
        // written, keys looked up.
        let layout = std::alloc::Layout::from_size_align(n, 8).unwrap();
        let heap_t = per_op(2000, || {
            use allocator_api2::alloc::Allocator;
            let p = heap.allocate(layout).unwrap().cast::<u8>();
            // SAFETY: p is a live n-byte allocation; freed right after with the same layout.
            unsafe {
                *p.as_ptr() = 1;
                black_box(mralloc::keys_of(p.as_ptr()).map(|k| k.lkey));
                heap.deallocate(p, layout);
            }
        });
        let naive_t = per_op(200, || {
            // SAFETY: malloc'd memory, registered, deregistered, then freed in that order.
            unsafe {
                let p = libc::malloc(n) as *mut u8;
                *p = 1;
                let mr = Mr::register(&pd, p, n, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
                black_box(mr.lkey());
                drop(mr);
                libc::free(p.cast());
            }
        });
        println!("{label}: heap alloc+free {heap_t:?}/op; malloc+reg_mr+dereg_mr+free {naive_t:?}/op");
        println!("RATIO naive_reg_vs_heap_{label} {:.1}", naive_t.as_secs_f64() / heap_t.as_secs_f64());
    }
    // First touch of a new chunk: a fresh heap, one allocation that needs its own chunk
    // (map + mbind + advise + ibv_reg_mr of untouched pages).
    for mib in [2usize, 16, 64] {
        let h = Heap::builder().bind(&pd).max_chunk(mib << 20).build()?;
        let t = Instant::now();
        let b = h.alloc((mib << 20) - 4096)?;
        let first = t.elapsed();
        let st = h.stats();
        println!(
            "first touch of a new {mib} MiB chunk: {first:?} ({:?} of it in ibv_reg_mr, {} reg calls)",
            st.reg_mr_time, st.reg_mr_calls
        );
        println!("FIGURE first_touch_chunk_{mib}MiB_ms {:.2}", first.as_secs_f64() * 1e3);
        drop(b);
    }
    let bufs: Vec<_> = (0..256).map(|i| heap.alloc(64 + i * 101).unwrap()).collect();
    let mut i = 0;
    let lookup = per_op(200_000, || {
        i = (i + 1) & 255;
        black_box(mralloc::keys_of(black_box(bufs[i].as_ptr())));
    });
    println!("FIGURE keys_of_bound_vm_ns {:.1}", lookup.as_secs_f64() * 1e9);
    Ok(())
}
