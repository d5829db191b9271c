//! Transfer speed with mralloc's API, shaped like perftest so `scripts/bench-transfer` can run
//! both in one VM boot and print ratios. Both sides run in this process (two connected QPs on
//! one device, as perftest's client and server on one device).
//!
//! ```text
//! transfer <write_bw|write_bw_8qp|read_bw|send_bw|write_lat|read_lat|send_lat> [--size BYTES] [--iters N]
//!          [--depth N] [--inline BYTES]
//! ```
//! Prints `MRALLOC <test> <MiB/s>` for bandwidth and `MRALLOC <test> <typical µs> <p99 µs>
//! <inline bytes used>` for latency. Latency is computed as perftest's `print_report_lat`: the samples are the intervals
//! between consecutive posts of the timed side (everything the loop does is inside one), the two
//! largest are dropped, typical is their median and ping-pong tests report half the round trip.
//! `--inline` (default 0, what perftest uses on devices it does not recognize, rxe among them)
//! is the most bytes a SEND or WRITE carries inline. Blocking waits busy-poll
//! ([`WaitMode::BusyPoll`]), as perftest does.
//!
//! With the `tokio` feature, `async_write_bw` and `async_write_lat` run the same loops through
//! `AsyncConnection` on a 2-worker tokio runtime: every post is an operation future, every
//! completion is awaited. `--workers N` sets the runtime's worker threads (0: a current-thread
//! runtime, bandwidth only) and `--spin-us N` the connection's `WaitOptions::spin`, to see what
//! limits them. `async_many --conns K` drives K connections from one task (one WRITE in flight on
//! each per round) and prints `MRALLOC async_many <K> <round p50 µs> <round p99 µs> <ops/s>`.
//!
//! Under `cargo bench` (`--bench`) without MRALLOC_DEVICE or without a test name nothing runs;
//! `--list` lists nothing. `transfer --help` lists the options.

mod common;

use std::time::Instant;

use common::{perftest_latency, Stamps};

use std::collections::VecDeque;

use mralloc::heap::{Buffer, Exposed, Heap};
use mralloc::transfer::{Connection, Options, Pending, QpOptions, WaitMode, WaitOptions};
use mralloc::verbs::{Access, Pd};

#[derive(Clone)]
struct Args {
    test: String,
    size: usize,
    iters: usize,
    depth: u32,
    inline: u32,
    /// Async tests: tokio worker threads (0: a current-thread runtime).
    workers: usize,
    /// Async tests: `WaitOptions::spin` in µs (None: the default).
    spin_us: Option<u64>,
    /// `async_many`: connections driven by one task.
    conns: usize,
}

const USAGE: &str = "\
usage: transfer TEST [--size BYTES] [--iters N] [--depth N] [--inline BYTES]
                     [--workers N] [--spin-us N] [--conns K]

Transfer speed with mralloc's API, shaped like perftest (both sides in this process, on the
RDMA device MRALLOC_DEVICE or the first active one).

tests:
  write_bw write_bw_8qp read_bw send_bw    MRALLOC <test> <MiB/s>
  write_lat read_lat send_lat              MRALLOC <test> <typical µs> <p99 µs> <inline bytes>
  async_write_bw async_write_lat           the same through AsyncConnection (feature tokio)
  async_many                               MRALLOC async_many <K> <round p50 µs> <round p99 µs> <ops/s>
                                           (feature tokio)

options:
  --size BYTES    message size (default 65536)
  --iters N       iterations (default 1000)
  --depth N       send queue depth: operations in flight (default 128)
  --inline BYTES  the most bytes a SEND or WRITE carries inline (default 0)
  --workers N     async tests: tokio worker threads, 0 for a current-thread runtime (default 2)
  --spin-us N     async tests: WaitOptions::spin in µs (default: the crate's)
  --conns K       async_many: connections driven by one task (default 64)
  --bench         given by cargo bench: without MRALLOC_DEVICE or a test, nothing runs (an
                  unknown test name or further positional arguments are then not an error)
  --list          lists nothing (these are not criterion benchmarks) and exits
  -h, --help      print this help
";

/// The tests every build runs.
const TESTS: &[&str] = &["write_bw", "write_bw_8qp", "read_bw", "send_bw", "write_lat", "read_lat", "send_lat"];
/// The tests a build with the `tokio` feature runs too.
#[cfg(feature = "tokio")]
const ASYNC_TESTS: &[&str] = &["async_write_bw", "async_write_lat", "async_many"];
#[cfg(not(feature = "tokio"))]
const ASYNC_TESTS: &[&str] = &[];

/// The command line, and whether it was given by a tool (`--bench`: cargo bench; `--list`).
fn args() -> (Args, common::Cli) {
    let mut a = Args {
        test: String::new(),
        size: 65536,
        iters: 1000,
        depth: 128,
        inline: 0,
        workers: 2,
        spin_us: None,
        conns: 64,
    };
    let cli = common::command_line(USAGE, 1, |name, p| {
        match name {
            "size" => a.size = common::number(p, name)?,
            "iters" => a.iters = common::number(p, name)?,
            "depth" => a.depth = common::number(p, name)?,
            "inline" => a.inline = common::number(p, name)?,
            "workers" => a.workers = common::number(p, name)?,
            "conns" => a.conns = common::number(p, name)?,
            "spin-us" => a.spin_us = Some(common::number(p, name)?),
            _ => return Ok(false),
        }
        Ok(true)
    });
    a.test = cli.positional.first().cloned().unwrap_or_default();
    let known = [TESTS, ASYNC_TESTS].concat();
    if !(cli.bench || cli.list || a.test.is_empty() || known.contains(&a.test.as_str())) {
        common::usage_error(USAGE, &format!("unknown test {} (this build has: {})", a.test, known.join(" ")));
    }
    (a, cli)
}

/// `k` receives of `n`-byte heap buffers posted on `c`, oldest first.
fn prepost<'c>(c: &'c Connection, heap: &Heap, n: usize, k: usize) -> mralloc::Result<VecDeque<Pending<'c, Buffer>>> {
    (0..k).map(|_| c.post_recv(heap.alloc(n)?).map_err(|r| r.error)).collect()
}

/// Spins until the peer's RDMA WRITE puts `tag` in the last of the inbox's `n` bytes.
fn spin_until(inbox: &Exposed, n: usize, tag: u8) {
    // SAFETY: a volatile read of the inbox's last byte (n - 1 < n, the inbox's length: in
    // bounds), which the peer writes by RDMA; no reference to the exposed bytes is made.
    while unsafe { std::ptr::read_volatile(inbox.as_ptr().add(n - 1)) } != tag {
        std::hint::spin_loop();
    }
}

/// The inline size the payload-carrying posts used: `--inline` when the message fits, else 0.
fn inline_used(a: &Args) -> u32 {
    if a.size <= a.inline as usize {
        a.inline
    } else {
        0
    }
}

fn main() -> mralloc::Result<()> {
    let (a, cli) = args();
    if cli.list {
        return Ok(());
    }
    if a.test.is_empty() || std::env::var("MRALLOC_DEVICE").is_err() && cli.bench {
        println!("transfer: needs a test name and an RDMA device; run scripts/bench-transfer");
        return Ok(());
    }
    let ctx = Options::default().open_device()?;
    let pd = Pd::new(&ctx)?;
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build()?;
    let opts = Options {
        qp: QpOptions {
            send_depth: a.depth,
            recv_depth: a.depth.max(512),
            remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            max_inline: a.inline,
            ..Default::default()
        },
        // Blocking waits busy-poll, as perftest does (the default sleeps after a short spin).
        wait: WaitOptions { mode: WaitMode::BusyPoll, ..Default::default() },
        ..Options::default()
    };
    let (x, y) = Connection::pair(&pd, &opts)?;
    let n = a.size;
    let mut src = heap.alloc(n)?;
    src.fill(0x5a);
    // The WRITE tests write into dst, the READ tests read it: exposed, with a key for both.
    let dst = heap.alloc(n)?.expose()?;
    let remote = dst.remote();
    let mib = |bytes: usize, secs: f64| bytes as f64 / secs / (1u64 << 20) as f64;
    match a.test.as_str() {
        "write_bw" | "read_bw" => {
            // READ targets must not alias: one slice per iteration of one big buffer.
            let mut back = heap.alloc(if a.test == "read_bw" { n * a.iters } else { 1 })?;
            let t = Instant::now();
            let mut b = x.batch();
            if a.test == "write_bw" {
                for _ in 0..a.iters {
                    b.write(&src, &remote, 0)?;
                }
            } else {
                for target in back.chunks_mut(n) {
                    b.read(target, &remote, 0)?;
                }
            }
            b.submit()?;
            println!("MRALLOC {} {:.2}", a.test, mib(n * a.iters, t.elapsed().as_secs_f64()));
        }
        "write_bw_8qp" => {
            // As `ib_write_bw -q 8`: eight connections between the same two ends, each with
            // `depth` WRITEs of the shared source in flight, driven round robin by one thread
            // (perftest drives its QPs from one thread too); `iters` WRITEs per connection.
            let pairs: Vec<_> = (0..8).map(|_| Connection::pair(&pd, &opts)).collect::<mralloc::Result<_>>()?;
            let src = std::sync::Arc::new(src);
            let mut inflight: Vec<VecDeque<Pending<'_, std::sync::Arc<Buffer>>>> =
                pairs.iter().map(|_| VecDeque::new()).collect();
            let mut posted = vec![0usize; pairs.len()];
            let t = Instant::now();
            loop {
                let mut busy = false;
                for (i, (c, _)) in pairs.iter().enumerate() {
                    while posted[i] < a.iters && inflight[i].len() < a.depth as usize {
                        inflight[i].push_back(c.post_write(src.clone(), &remote, 0)?);
                        posted[i] += 1;
                    }
                    if let Some(p) = inflight[i].pop_front() {
                        p.wait()?;
                        busy = true;
                    }
                }
                if !busy {
                    break;
                }
            }
            println!("MRALLOC {} {:.2}", a.test, mib(n * a.iters * pairs.len(), t.elapsed().as_secs_f64()));
        }
        "send_bw" => {
            // As ib_send_bw: the receiver's window of receives is posted before the clock starts.
            let ready = std::sync::Barrier::new(2);
            let mut t = Instant::now();
            std::thread::scope(|s| -> mralloc::Result<()> {
                let recv = s.spawn(|| -> mralloc::Result<()> {
                    let mut pend = VecDeque::new();
                    let window = (opts.qp.recv_depth as usize).min(a.iters);
                    let mut posted = 0;
                    while posted < window {
                        pend.push_back(y.post_recv(heap.alloc(n)?)?);
                        posted += 1;
                    }
                    ready.wait();
                    for _ in 0..a.iters {
                        let p = pend.pop_front().expect("a posted receive");
                        let (buf, _) = p.wait()?;
                        if posted < a.iters {
                            pend.push_back(y.post_recv(buf)?);
                            posted += 1;
                        }
                    }
                    Ok(())
                });
                ready.wait();
                t = Instant::now();
                let mut b = x.batch();
                for _ in 0..a.iters {
                    b.send(&src)?;
                }
                b.submit()?;
                recv.join().expect("receiver thread")
            })?;
            println!("MRALLOC send_bw {:.2}", mib(n * a.iters, t.elapsed().as_secs_f64()));
        }
        "write_lat" => {
            // Ping-pong through memory, as ib_write_lat: post the write, spin on the own inbox
            // for the peer's, then reap the own send completion; the sample runs from one post
            // to the next.
            let inbox_x = heap.alloc(n)?.expose()?;
            let inbox_y = heap.alloc(n)?.expose()?;
            let (rx, ry) = (inbox_x.remote(), inbox_y.remote());
            let spin = |inbox: &Exposed, tag: u8| spin_until(inbox, n, tag);
            let mut posted = Stamps::with_capacity(a.iters);
            std::thread::scope(|s| -> mralloc::Result<()> {
                let pong = s.spawn(|| -> mralloc::Result<()> {
                    let mut out = heap.alloc(n)?;
                    for i in 0..a.iters {
                        let tag = (i % 251 + 1) as u8;
                        spin(&inbox_y, tag);
                        out[n - 1] = tag;
                        let p = y.post_write(out, &rx, 0)?;
                        out = p.wait()?.0;
                    }
                    Ok(())
                });
                let mut out = heap.alloc(n)?;
                for i in 0..a.iters {
                    let tag = (i % 251 + 1) as u8;
                    out[n - 1] = tag;
                    posted.push();
                    let p = x.post_write(out, &ry, 0)?;
                    spin(&inbox_x, tag);
                    out = p.wait()?.0;
                }
                pong.join().expect("pong thread")
            })?;
            let (typical, p99) = perftest_latency(&posted, 2.0);
            println!("MRALLOC write_lat {typical:.2} {p99:.2} {}", inline_used(&a));
        }
        "read_lat" => {
            let mut back = heap.alloc(n)?;
            let mut posted = Stamps::with_capacity(a.iters);
            for _ in 0..a.iters {
                posted.push();
                x.read(&mut back, &remote, 0)?;
            }
            let (typical, p99) = perftest_latency(&posted, 1.0);
            println!("MRALLOC read_lat {typical:.2} {p99:.2} 0");
        }
        "send_lat" => {
            // Ping-pong with SENDs, as ib_send_lat: min(512, iters) receives pre-posted on both
            // sides (before the first SEND), one re-posted after each arrival only while more are
            // still to come; the sample runs from one post to the next (receive, re-post, reap
            // the own send).
            let rx_depth = a.iters.min(512);
            let ready = std::sync::Barrier::new(2);
            let pre = |c| prepost(c, &heap, n, rx_depth);
            let mut posted = Stamps::with_capacity(a.iters);
            std::thread::scope(|s| -> mralloc::Result<()> {
                let pong = s.spawn(|| -> mralloc::Result<()> {
                    let mut rx = pre(&y)?;
                    let mut reposted = rx_depth;
                    let mut out = heap.alloc(n)?;
                    ready.wait();
                    for _ in 0..a.iters {
                        let (inbox, _) = rx.pop_front().expect("a posted receive").wait()?;
                        if reposted < a.iters {
                            rx.push_back(y.post_recv(inbox)?);
                            reposted += 1;
                        }
                        out = y.post_send(out)?.wait()?.0;
                    }
                    Ok(())
                });
                let mut rx = pre(&x)?;
                let mut reposted = rx_depth;
                let mut out = heap.alloc(n)?;
                ready.wait();
                for _ in 0..a.iters {
                    posted.push();
                    let sent = x.post_send(out)?;
                    let (inbox, _) = rx.pop_front().expect("a posted receive").wait()?;
                    if reposted < a.iters {
                        rx.push_back(x.post_recv(inbox)?);
                        reposted += 1;
                    }
                    out = sent.wait()?.0;
                }
                pong.join().expect("pong thread")
            })?;
            let (typical, p99) = perftest_latency(&posted, 2.0);
            println!("MRALLOC send_lat {typical:.2} {p99:.2} {}", inline_used(&a));
        }
        #[cfg(feature = "tokio")]
        "async_write_bw" | "async_write_lat" | "async_many" => asynchronous::run(&a, &pd, &heap, &opts)?,
        other => {
            eprintln!("transfer: unknown test {other}");
            std::process::exit(2);
        }
    }
    Ok(())
}

#[cfg(feature = "tokio")]
mod asynchronous {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::time::Instant;

    use hdrhistogram::Histogram;
    use mralloc::heap::Heap;
    use mralloc::transfer::{AsyncConnection, Options};
    use mralloc::verbs::Pd;

    use super::{inline_used, perftest_latency, spin_until, Args, Stamps};

    pub fn run(a: &Args, pd: &Pd, heap: &Heap, opts: &Options) -> mralloc::Result<()> {
        if a.workers == 0 && a.test == "async_write_lat" {
            // Both sides spin on their inboxes: on one thread the ping would wait for itself.
            eprintln!("transfer: async_write_lat needs --workers 1 or more");
            std::process::exit(2);
        }
        let mut builder = if a.workers == 0 {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(a.workers);
            b
        };
        let rt = builder
            .enable_all()
            .build()
            .map_err(|source| mralloc::Error::Io { what: "building the tokio runtime".into(), source })?;
        let mut opts = opts.clone();
        if let Some(us) = a.spin_us {
            opts.wait.spin = std::time::Duration::from_micros(us);
        }
        rt.block_on(async {
            if a.test == "async_many" {
                return many(a, pd, heap, &opts).await;
            }
            let (x, y) = AsyncConnection::pair(pd, &opts)?;
            if a.test == "async_write_lat" {
                // The ping side spins on its inbox between operations: in block_on, not on a
                // worker (a worker spinning would starve a task woken into its LIFO slot).
                return write_lat(a, heap, x, y).await;
            }
            // The loop runs as a task (on a worker, as a service's would), not in block_on.
            let (a, heap) = (a.clone(), heap.clone());
            tokio::spawn(async move { write_bw(&a, &heap, &x).await }).await.expect("the benchmark task")
        })
    }

    /// As write_bw: `depth` WRITEs of one source buffer in flight (an `Arc`, shared by every
    /// operation as perftest shares one buffer), each awaited in order.
    async fn write_bw(a: &Args, heap: &Heap, x: &AsyncConnection) -> mralloc::Result<()> {
        let n = a.size;
        let mut src = heap.alloc(n)?;
        src.fill(0x5a);
        let src = Arc::new(src);
        let dst = heap.alloc(n)?.expose()?;
        let remote = dst.remote();
        let mut inflight = VecDeque::with_capacity(a.depth as usize);
        let t = Instant::now();
        for _ in 0..a.iters {
            if inflight.len() == a.depth as usize {
                let op: std::pin::Pin<Box<_>> = inflight.pop_front().expect("in flight");
                op.await?;
            }
            inflight.push_back(Box::pin(x.write(src.clone(), &remote, 0)));
        }
        for op in inflight {
            op.await?;
        }
        let secs = t.elapsed().as_secs_f64();
        println!("MRALLOC async_write_bw {:.2}", (n * a.iters) as f64 / secs / (1u64 << 20) as f64);
        Ok(())
    }

    /// Many connections, one task: `conns` connected pairs; every round posts one `size`-byte
    /// WRITE on each connection (each into its own slice of one exposed buffer), then awaits
    /// them all in order. Prints the rounds' median and p99 (µs, from a histogram with 3
    /// significant digits) and operations per second.
    async fn many(a: &Args, pd: &Pd, heap: &Heap, opts: &Options) -> mralloc::Result<()> {
        let (n, k) = (a.size, a.conns);
        let pairs = (0..k).map(|_| AsyncConnection::pair(pd, opts)).collect::<mralloc::Result<Vec<_>>>()?;
        let dst = heap.alloc(n * k)?.expose()?;
        let remote = dst.remote();
        let mut bufs = (0..k).map(|_| heap.alloc(n)).collect::<mralloc::Result<Vec<_>>>()?;
        let mut rounds = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds");
        let t = Instant::now();
        for _ in 0..a.iters {
            let r = Instant::now();
            let ops: Vec<_> = pairs
                .iter()
                .zip(bufs.drain(..))
                .enumerate()
                .map(|(i, ((x, _), b))| x.write(b, &remote, (i * n) as u64))
                .collect();
            for op in ops {
                bufs.push(op.await?);
            }
            rounds.saturating_record(u64::try_from(r.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
        let secs = t.elapsed().as_secs_f64();
        let us = |ns: u64| ns as f64 / 1e3;
        let (p50, p99) = (rounds.value_at_quantile(0.5), rounds.value_at_quantile(0.99));
        println!("MRALLOC async_many {k} {:.2} {:.2} {:.0}", us(p50), us(p99), (k * a.iters) as f64 / secs);
        Ok(())
    }

    /// As write_lat, with each side a task: post the WRITE (an operation future), spin on the
    /// own inbox for the peer's, then await the own WRITE's completion.
    async fn write_lat(a: &Args, heap: &Heap, x: AsyncConnection, y: AsyncConnection) -> mralloc::Result<()> {
        let n = a.size;
        let inbox_x = Arc::new(heap.alloc(n)?.expose()?);
        let inbox_y = Arc::new(heap.alloc(n)?.expose()?);
        let (rx, ry) = (inbox_x.remote(), inbox_y.remote());
        let iters = a.iters;
        let (heap2, iy) = (heap.clone(), inbox_y.clone());
        let pong = tokio::spawn(async move {
            let mut out = heap2.alloc(n)?;
            for i in 0..iters {
                let tag = (i % 251 + 1) as u8;
                spin_until(&iy, n, tag);
                out[n - 1] = tag;
                out = y.write(out, &rx, 0).await?;
            }
            Ok::<(), mralloc::Error>(())
        });
        let mut out = heap.alloc(n)?;
        let mut posted = Stamps::with_capacity(iters);
        for i in 0..iters {
            let tag = (i % 251 + 1) as u8;
            out[n - 1] = tag;
            posted.push();
            let op = x.write(out, &ry, 0);
            spin_until(&inbox_x, n, tag);
            out = op.await?;
        }
        pong.await.expect("pong task")?;
        let (typical, p99) = perftest_latency(&posted, 2.0);
        println!("MRALLOC async_write_lat {typical:.2} {p99:.2} {}", inline_used(a));
        Ok(())
    }
}
