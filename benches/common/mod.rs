//! What the benchmarks share: sizes, labels, criterion settings (allocation), medians, the
//! command line of the benches that are not criterion's.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::OsString;
use std::hint::black_box;
use std::time::Duration;

use criterion::Criterion;
use lexopt::ValueExt;

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

/// The command line of a bench binary that is not criterion's, past its own options.
pub struct Cli {
    /// `--bench` was given: run by `cargo bench`, which passes it to every bench binary.
    pub bench: bool,
    /// `--list` was given (test tools, criterion's convention): there is nothing to list.
    pub list: bool,
    /// Positional arguments, in order.
    pub positional: Vec<String>,
}

/// Why [`parse_command_line`] returned no command line to run with.
#[derive(Debug)]
pub enum Stop {
    Help,
    Error(String),
}

/// Parses `args` (without the program name): `option(name, parser)` takes the value of an option
/// `--name` it knows with `parser.value()` and returns `Ok(true)`, or `Ok(false)` for one it does
/// not know (an error). `--bench` and `--list` are always accepted. More than `max_positional`
/// positional arguments are an error, except with `--bench` or `--list`: `cargo bench -- FILTER`
/// passes criterion's filter to every bench binary, and these ignore it.
pub fn parse_command_line<I>(
    args: I,
    max_positional: usize,
    mut option: impl FnMut(&str, &mut lexopt::Parser) -> Result<bool, lexopt::Error>,
) -> Result<Cli, Stop>
where
    I: IntoIterator,
    I::Item: Into<OsString>,
{
    use lexopt::prelude::*;
    let error = |e: lexopt::Error| Stop::Error(e.to_string());
    let mut p = lexopt::Parser::from_args(args);
    let mut cli = Cli { bench: false, list: false, positional: Vec::new() };
    while let Some(arg) = p.next().map_err(error)? {
        match arg {
            Short('h') | Long("help") => return Err(Stop::Help),
            Long("bench") => cli.bench = true,
            Long("list") => cli.list = true,
            Long(name) => {
                let name = name.to_string();
                if !option(&name, &mut p).map_err(error)? {
                    return Err(Stop::Error(format!("unknown option --{name}")));
                }
            }
            Value(v) => cli.positional.push(v.string().map_err(error)?),
            other => return Err(error(other.unexpected())),
        }
    }
    if !(cli.bench || cli.list) && cli.positional.len() > max_positional {
        return Err(Stop::Error(format!("unexpected argument {:?}", cli.positional[max_positional])));
    }
    Ok(cli)
}

/// This process's command line, as [`parse_command_line`] reads it: `--help` prints `usage` and
/// exits 0; a mistake exits 2 with `error: ...` and the usage.
pub fn command_line(
    usage: &str,
    max_positional: usize,
    option: impl FnMut(&str, &mut lexopt::Parser) -> Result<bool, lexopt::Error>,
) -> Cli {
    match parse_command_line(std::env::args_os().skip(1), max_positional, option) {
        Ok(cli) => cli,
        Err(Stop::Help) => {
            print!("{usage}");
            std::process::exit(0)
        }
        Err(Stop::Error(msg)) => usage_error(usage, &msg),
    }
}

/// Exits with `error: <msg>` and the usage on stderr, status 2.
pub fn usage_error(usage: &str, msg: &str) -> ! {
    eprintln!("error: {msg}\n");
    eprint!("{usage}");
    std::process::exit(2)
}

/// The value of an option as text.
pub fn text(p: &mut lexopt::Parser) -> Result<String, lexopt::Error> {
    p.value()?.string()
}

/// The value of option `--name` as a number.
pub fn number<T: std::str::FromStr>(p: &mut lexopt::Parser, name: &str) -> Result<T, lexopt::Error> {
    let v = p.value()?.string()?;
    v.parse().map_err(|_| lexopt::Error::from(format!("--{name} {v}: not a number")))
}

/// The value of option `--name` as a number above 0.
pub fn positive<T: std::str::FromStr + Default + PartialOrd>(
    p: &mut lexopt::Parser,
    name: &str,
) -> Result<T, lexopt::Error> {
    let n: T = number(p, name)?;
    if n > T::default() {
        Ok(n)
    } else {
        Err(format!("--{name} must be above 0").into())
    }
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

/// Post timestamps taken the way perftest takes them: the CPU's cycle counter (`rdtsc` on
/// x86_64), which costs no system call where the clock does (the Soft-RoCE VM's clocksource is
/// not the TSC, so `Instant::now` enters the kernel there, which perftest's loop never does).
/// Cycles become time by calibration against the clock over the whole run, which perftest
/// instead reads from /proc/cpuinfo. Elsewhere the clock itself.
pub struct Stamps {
    t0: std::time::Instant,
    c0: u64,
    ticks: Vec<u64>,
}

#[cfg(target_arch = "x86_64")]
fn cycles() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86_64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
fn cycles() -> u64 {
    static T0: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    T0.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64
}

impl Stamps {
    pub fn with_capacity(n: usize) -> Stamps {
        Stamps { t0: std::time::Instant::now(), c0: cycles(), ticks: Vec::with_capacity(n) }
    }

    /// Records the moment of a post.
    #[inline]
    pub fn push(&mut self) {
        self.ticks.push(cycles());
    }

    /// The posts' moments in µs since the first, the counter calibrated against the clock
    /// from construction to now.
    pub fn micros(&self) -> Vec<f64> {
        let ns = self.t0.elapsed().as_nanos() as f64;
        let per_us = cycles().wrapping_sub(self.c0) as f64 / ns * 1e3;
        let first = self.ticks.first().copied().unwrap_or(0);
        // Signed: a counter that is not synchronised across CPUs could step back when the
        // thread moves; such a step shows as a negative interval (reported, not wrapped).
        let v: Vec<f64> = self.ticks.iter().map(|&c| c.wrapping_sub(first) as i64 as f64 / per_us).collect();
        let back = v.windows(2).filter(|w| w[1] < w[0]).count();
        if back > 0 {
            eprintln!("warning: the cycle counter stepped back {back} times (not synchronised across CPUs?)");
        }
        v
    }
}

/// Latency statistics computed as perftest's `print_report_lat` does, from the moments at which
/// each iteration's first work request was posted: one sample per interval between consecutive
/// posts (so a sample includes everything the loop does: the wait for the peer, reaping the own
/// completion, re-posting the receive), sorted, the two largest dropped, each divided by
/// `rtt_factor` (2 for ping-pong tests, 1 for READ). Returns (typical = perftest's median, p99)
/// in µs. Panics with fewer than 4 posts.
pub fn perftest_latency(posted: &Stamps, rtt_factor: f64) -> (f64, f64) {
    let posted = posted.micros();
    assert!(posted.len() >= 4, "need at least 4 iterations");
    let mut delta: Vec<f64> = posted.windows(2).map(|w| (w[1] - w[0]) / rtt_factor).collect();
    delta.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let n = delta.len() - 2; // LAT_MEASURE_TAIL
    let typical = if (n - 1) % 2 == 1 { (delta[n / 2] + delta[n / 2 - 1]) / 2.0 } else { delta[n / 2] };
    let p99 = delta[((n as f64) * 0.99).ceil() as usize];
    (typical, p99)
}

/// Live objects in the window workload.
pub const WINDOW: usize = 1000;

/// A fixed pseudo-random script for the window workload: `(slot, size)` steps, sizes 16 B to
/// 4 KiB, the same for every allocator (xorshift, fixed seed).
pub fn window_script(steps: usize) -> Vec<(u16, u16)> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..steps).map(|_| ((next() % WINDOW as u64) as u16, (16 + next() % (4096 - 16 + 1)) as u16)).collect()
}

/// The window workload: `WINDOW` live objects of random sizes; each step frees one at random and
/// allocates a new one of another random size in its place. Returns the time for `iters` steps
/// (the window is filled before and emptied after the timing).
pub fn window(
    iters: u64,
    script: &[(u16, u16)],
    alloc: impl Fn(usize) -> *mut u8,
    free: impl Fn(*mut u8, usize),
) -> Duration {
    let mut live: Vec<(*mut u8, usize)> =
        script[..WINDOW].iter().map(|&(_, n)| (alloc(n as usize), n as usize)).collect();
    let t = std::time::Instant::now();
    for i in 0..iters as usize {
        let (slot, n) = script[i % script.len()];
        let (p, old) = live[slot as usize];
        free(p, old);
        live[slot as usize] = (std::hint::black_box(alloc(n as usize)), n as usize);
    }
    let d = t.elapsed();
    for (p, n) in live {
        free(p, n);
    }
    d
}

/// Cross-thread frees: a producer allocates objects of `size` bytes in batches of 256 and hands
/// each batch to a consumer thread, which frees them (the pattern of a receive path handing
/// buffers to workers). Returns the time for `iters` objects (both threads running).
pub fn cross_thread(
    iters: u64,
    size: usize,
    alloc: impl Fn(usize) -> *mut u8 + Sync,
    free: impl Fn(*mut u8, usize) + Sync,
) -> Duration {
    const BATCH: usize = 256;
    let (to_consumer, batches) = std::sync::mpsc::sync_channel::<Vec<usize>>(4);
    let (to_producer, empties) = std::sync::mpsc::sync_channel::<Vec<usize>>(4);
    for _ in 0..4 {
        to_producer.send(Vec::with_capacity(BATCH)).unwrap();
    }
    let free = &free;
    std::thread::scope(|s| {
        s.spawn(move || {
            for mut b in batches {
                for p in b.drain(..) {
                    free(p as *mut u8, size);
                }
                if to_producer.send(b).is_err() {
                    break;
                }
            }
        });
        let t = std::time::Instant::now();
        let mut left = iters as usize;
        while left > 0 {
            let mut b = empties.recv().unwrap();
            let n = left.min(BATCH);
            b.extend((0..n).map(|_| alloc(size) as usize));
            left -= n;
            to_consumer.send(b).unwrap();
        }
        drop(to_consumer);
        // Wait for the consumer to free the last batch (it returns every batch).
        for _ in 0..4 {
            let _ = empties.recv();
        }
        t.elapsed()
    })
}

/// The process allocator through `std::alloc` (what `Vec` and `Box` use).
pub struct ProcessAlloc;

// SAFETY: forwards to the process allocator, which upholds the contract.
unsafe impl GlobalAlloc for ProcessAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { std::alloc::alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds `GlobalAlloc::dealloc`'s contract.
        unsafe { std::alloc::dealloc(ptr, layout) }
    }
}

/// One alloc+free pair, and a batch of 1000 allocations then 1000 frees, through `a`.
pub fn pair(a: &dyn GlobalAlloc, layout: Layout) {
    // SAFETY: a fresh allocation of `layout`, freed once with it.
    unsafe {
        let p = a.alloc(black_box(layout));
        black_box(p);
        a.dealloc(p, layout);
    }
}

pub fn batch(a: &dyn GlobalAlloc, layout: Layout, v: &mut Vec<*mut u8>) {
    // SAFETY: as in `pair`, 1000 times.
    unsafe {
        for _ in 0..1000 {
            v.push(a.alloc(layout));
        }
        for p in v.drain(..) {
            a.dealloc(p, layout);
        }
    }
}
