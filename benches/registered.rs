//! Registration cost on a real device (run in the VM by `scripts/bench-alloc`, in one boot):
//! a `Heap` bound to the device against the naive way — malloc + `ibv_reg_mr` + `ibv_dereg_mr` +
//! free per buffer — at 4 KiB and 64 KiB; `keys_of` on a bound heap against an unbound one; and
//! the cost of the first touch of a new chunk; idle release (resident memory after a burst and the
//! idle interval, and the re-registration of a released chunk it trades against); the worst
//! allocation while a heap grows to 256 MiB, without and with `Heap::reserve` (run by
//! `scripts/bench-transfer`, in its boot).
//!
//! ```text
//! registered [--rounds N] [--part all|alloc|growth|idle]
//! ```
//! `--part alloc` runs everything but the growth, `--part growth` only the growth, `--part idle`
//! only idle release. Under
//! `cargo bench` (`--bench`) without MRALLOC_DEVICE nothing runs; `--list` lists nothing.
//! Each comparison runs N rounds (default 5), the two sides back to back and in alternating
//! order; prints `RATIO <name> <median> [<min>-<max>]` over the per-round ratios and `FIGURE`
//! lines the same way. Numbers are measured, never typed in.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::median;
use lexopt::ValueExt;
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

/// `median [min-max]` of `v`.
fn spread(mut v: Vec<f64>) -> String {
    let m = median(&mut v);
    format!("{m:.3} [{:.3}-{:.3}]", v[0], v[v.len() - 1])
}

/// Runs `a` and `b` back to back `rounds` times, alternating which goes first; returns the
/// per-round values of both.
fn interleaved(rounds: usize, mut a: impl FnMut() -> f64, mut b: impl FnMut() -> f64) -> (Vec<f64>, Vec<f64>) {
    let (mut va, mut vb) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        if r % 2 == 0 {
            va.push(a());
            vb.push(b());
        } else {
            vb.push(b());
            va.push(a());
        }
    }
    (va, vb)
}

fn ratios(num: &[f64], den: &[f64]) -> Vec<f64> {
    num.iter().zip(den).map(|(n, d)| n / d).collect()
}

const USAGE: &str = "\
usage: registered [--rounds N] [--part all|alloc|growth|idle]

Registration cost on an RDMA device (MRALLOC_DEVICE, or the first active one): a bound Heap
against malloc + ibv_reg_mr per buffer, keys_of bound and unbound, the first touch of a chunk,
idle release and re-registration, the worst allocation while a heap grows to 256 MiB (without
and with Heap::reserve).

options:
  --rounds N      interleaved rounds per comparison (default 5)
  --part PART     all (default), alloc (everything but the growth), growth (only the growth) or
                  idle (only idle release)
  --bench         given by cargo bench: without MRALLOC_DEVICE, nothing runs (positional
                  arguments, cargo bench's filters, are then ignored)
  --list          lists nothing (these are not criterion benchmarks) and exits
  -h, --help      print this help
";

fn main() -> mralloc::Result<()> {
    let mut rounds = 5usize;
    let mut part = String::from("all");
    let cli = common::command_line(USAGE, 0, |name, p| {
        match name {
            "rounds" => rounds = common::positive(p, name)?,
            "part" => {
                part = p.value()?.string()?;
                if !["all", "alloc", "growth", "idle"].contains(&part.as_str()) {
                    return Err(format!("--part {part}: not all, alloc, growth or idle").into());
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    });
    if cli.list {
        return Ok(());
    }
    if cli.bench && std::env::var("MRALLOC_DEVICE").is_err() {
        // `cargo bench` on a host without a device: nothing to measure here (see scripts/bench-alloc).
        println!("registered: needs an RDMA device; run scripts/bench-alloc");
        return Ok(());
    }
    let ctx = Context::open_default()?;
    let pd = Pd::new(&ctx)?;
    println!("device {}, {rounds} rounds, part {part}", ctx.name());
    if part == "all" || part == "alloc" {
        alloc_and_registration(&pd, rounds)?;
    }
    if part != "growth" {
        idle_release(&pd, rounds)?;
    }
    if part == "all" || part == "growth" {
        growth(&pd, rounds)?;
    }
    Ok(())
}

/// The heap against malloc + `ibv_reg_mr`, `keys_of` bound and unbound, first touch of a chunk.
fn alloc_and_registration(pd: &Pd, rounds: usize) -> mralloc::Result<()> {
    let heap = Heap::builder().bind(pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE).build()?;
    for (n, label) in [(4096usize, "4KiB"), (65536, "64KiB")] {
        // Raw allocation through the Allocator API (like malloc below: no zero-fill), one byte
        // written, keys looked up.
        let layout = std::alloc::Layout::from_size_align(n, 8).unwrap();
        let heap_op = || {
            per_op(2000, || {
                use allocator_api2::alloc::Allocator;
                let p = heap.allocate(layout).unwrap().cast::<u8>();
                // SAFETY: p is a live n-byte allocation; freed right after with the same layout.
                unsafe {
                    *p.as_ptr() = 1;
                    black_box(mralloc::keys_of(p.as_ptr()).map(|k| k.lkey));
                    heap.deallocate(p, layout);
                }
            })
            .as_secs_f64()
                * 1e9
        };
        let naive_op = || {
            per_op(200, || {
                // SAFETY: malloc'd memory, registered, deregistered, then freed in that order.
                unsafe {
                    let p = libc::malloc(n) as *mut u8;
                    *p = 1;
                    let mr = Mr::register(pd, p, n, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
                    black_box(mr.lkey());
                    drop(mr);
                    libc::free(p.cast());
                }
            })
            .as_secs_f64()
                * 1e9
        };
        let (naive, heap_ns) = interleaved(rounds, naive_op, heap_op);
        println!(
            "{label}: heap alloc+free ns/op {}; malloc+reg_mr+dereg_mr+free ns/op {}",
            spread(heap_ns.clone()),
            spread(naive.clone())
        );
        println!("RATIO naive_reg_vs_heap_{label} {}", spread(ratios(&naive, &heap_ns)));
    }
    // keys_of on a bound heap (page map -> chunk record -> keys) against an unbound one (returns
    // after the chunk lookup finds no registration), in this boot.
    let unbound = Heap::builder().build()?;
    let bound_bufs: Vec<_> = (0..256).map(|i| heap.alloc(64 + i * 101).unwrap()).collect();
    let unbound_bufs: Vec<_> = (0..256).map(|i| unbound.alloc(64 + i * 101).unwrap()).collect();
    let lookup = |bufs: &[mralloc::heap::Buffer]| {
        let mut i = 0;
        per_op(200_000, || {
            i = (i + 1) & 255;
            black_box(mralloc::keys_of(black_box(bufs[i].as_ptr())));
        })
        .as_secs_f64()
            * 1e9
    };
    assert!(mralloc::keys_of(bound_bufs[0].as_ptr()).is_some() && mralloc::keys_of(unbound_bufs[0].as_ptr()).is_none());
    let (b, u) = interleaved(rounds, || lookup(&bound_bufs), || lookup(&unbound_bufs));
    println!("FIGURE keys_of_bound_vm_ns {}", spread(b.clone()));
    println!("FIGURE keys_of_unbound_vm_ns {}", spread(u.clone()));
    println!("RATIO keys_of_bound_vs_unbound_vm {}", spread(ratios(&b, &u)));
    // First touch of a new chunk: a fresh heap, one allocation that needs its own chunk
    // (map + mbind + advise + ibv_reg_mr of untouched pages).
    for mib in [2usize, 16, 64] {
        let mut ms = Vec::new();
        for _ in 0..rounds {
            let h = Heap::builder().bind(pd).max_chunk(mib << 20).build()?;
            let t = Instant::now();
            let b = h.alloc((mib << 20) - 4096)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            let st = h.stats();
            println!(
                "first touch of a new {mib} MiB chunk: {:.2} ms ({:?} of it in ibv_reg_mr, {} reg calls)",
                ms[ms.len() - 1],
                st.reg_mr_time,
                st.reg_mr_calls
            );
            drop(b);
        }
        println!("FIGURE first_touch_chunk_{mib}MiB_ms {}", spread(ms));
    }
    Ok(())
}

/// Resident bytes of this process (`/proc/self/statm`).
fn rss() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap() * 4096.0
}

/// Idle release on a bound heap: a burst fills a chunk, is freed, and after the idle interval
/// the chunk is deregistered and its pages dropped (resident memory after the idle interval
/// against before the burst); then the re-registration this trades against — the allocation
/// that uses the released chunk again (`ibv_reg_mr` of the whole chunk, its pages untouched).
fn idle_release(pd: &Pd, rounds: usize) -> mralloc::Result<()> {
    const IDLE: Duration = Duration::from_millis(500);
    for mib in [16usize, 64] {
        let (mut rereg, mut after_vs_before) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let h = Heap::builder().bind(pd).max_chunk(mib << 20).thread_cache(0).idle_release(Some(IDLE)).build()?;
            let before = rss();
            let mut b = h.alloc((mib << 20) - 4096)?;
            b.fill(1);
            let busy = rss();
            drop(b);
            // jemalloc's decay takes the free in at its next run (any allocation's side effect,
            // here on demand) and releases the chunk an interval later.
            h.decay()?;
            std::thread::sleep(IDLE + IDLE / 2);
            h.decay()?;
            let idle = rss();
            let st = h.stats();
            assert!(st.idle_chunks >= 1, "the burst's chunk was not released: {st:?}");
            let t = Instant::now();
            let again = h.alloc((mib << 20) - 4096)?;
            rereg.push(t.elapsed().as_secs_f64() * 1e3);
            let reg = h.stats().reg_mr_time - st.reg_mr_time;
            after_vs_before.push(idle / before);
            println!(
                "{mib} MiB chunk: RSS {:.1} MiB before, {:.1} busy, {:.1} after idle release; re-registration {:.2} ms ({reg:?} in ibv_reg_mr)",
                before / 1048576.0,
                busy / 1048576.0,
                idle / 1048576.0,
                rereg[rereg.len() - 1]
            );
            drop(again);
        }
        println!("FIGURE idle_rereg_chunk_{mib}MiB_ms {}", spread(rereg));
        println!("RATIO idle_rss_after_vs_before_burst_{mib}MiB_vm {}", spread(after_vs_before));
    }
    Ok(())
}

/// Growth from 0 to 256 MiB live in 1 MiB buffers on a fresh bound heap: the worst single
/// allocation (it makes and registers a chunk), without and with `reserve(272 MiB)` first.
fn growth(pd: &Pd, rounds: usize) -> mralloc::Result<()> {
    let grow = |reserve: bool| -> mralloc::Result<f64> {
        use allocator_api2::alloc::Allocator;
        let h = Heap::builder().bind(pd).build()?;
        let t = Instant::now();
        if reserve {
            // 256 MiB of buffers (1 MiB is a size class) and a sixteenth of headroom (the page
            // each large allocation takes beyond its class, chunk ends), as Heap::reserve's
            // documentation advises.
            h.reserve((256 << 20) + (16 << 20))?;
        }
        let reserve_ms = t.elapsed().as_secs_f64() * 1e3;
        let layout = std::alloc::Layout::from_size_align(1 << 20, 8).unwrap();
        let mut worst = 0f64;
        let mut held = Vec::with_capacity(256);
        for _ in 0..256 {
            let t = Instant::now();
            let p = h
                .allocate(layout)
                .map_err(|_| mralloc::Error::OutOfMemory { requested: 1 << 20, why: "heap growth bench" })?;
            worst = worst.max(t.elapsed().as_secs_f64() * 1e3);
            held.push(p.cast::<u8>());
        }
        let st = h.stats();
        println!(
            "growth to 256 MiB{}: worst allocation {worst:.2} ms, {} chunks, {} reg calls, {:?} in ibv_reg_mr{}",
            if reserve { " after reserve" } else { "" },
            st.chunks,
            st.reg_mr_calls,
            st.reg_mr_time,
            if reserve { format!(" (reserve took {reserve_ms:.1} ms)") } else { String::new() }
        );
        for p in held {
            // SAFETY: allocated above with `layout`, freed once.
            unsafe { h.deallocate(p, layout) };
        }
        Ok(worst)
    };
    let (plain, reserved) = interleaved(rounds, || grow(false).unwrap(), || grow(true).unwrap());
    println!("FIGURE heap_growth_worst_alloc_ms {}", spread(plain));
    println!("FIGURE heap_growth_worst_alloc_ms_reserved {}", spread(reserved));
    Ok(())
}
