//! What exposing one buffer to a peer costs, per way of doing it (run by
//! `scripts/bench-transfer` in the Soft-RoCE VM, or on a host with an RDMA device):
//!
//! - `buffer`: [`Buffer::remote`] + [`Buffer::revoke_remote`] — a registration of exactly the
//!   buffer (`ibv_reg_mr` + `ibv_dereg_mr`), the default;
//! - `grant`: [`Connection::grant`] + `Grant::revoke` — a type 2 memory window bound and
//!   invalidated through the connection (two work requests and their completions), over the
//!   heap chunk where the device confines windows, else over a registration of exactly the
//!   buffer with local rights only (so on Soft-RoCE: `buffer`'s registration plus the window);
//! - `whole_chunk`: [`Buffer::remote_whole_chunk`] — the chunk's rkey, a page-map lookup;
//! - `write`: one RDMA WRITE of the same size on the same connection, for scale.
//!
//! After one uncounted warm-up round, the four are measured in interleaved rounds (each round runs every method `--iters` times
//! per size); a line per method and size gives the median over rounds of the per-round median
//! and the spread of those round medians:
//! ```text
//! EXPOSE <method> <size> <median µs> <min µs> <max µs>
//! ```
//! Usage: `exposure [--iters N] [--rounds N]`. Under `cargo bench` (`--bench`) without
//! MRALLOC_DEVICE nothing runs; `--list` lists nothing.

mod common;

use std::time::Instant;

use common::median;

use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Options, QpOptions};
use mralloc::verbs::{Access, Pd};

const SIZES: [usize; 4] = [64, 4096, 65536, 1 << 20];
const METHODS: [&str; 4] = ["buffer", "grant", "whole_chunk", "write"];

const USAGE: &str = "\
usage: exposure [--iters N] [--rounds N]

What exposing one buffer to a peer costs (a registration of its own, a memory window grant, the
chunk's key) next to one RDMA WRITE of the same size, on an RDMA device (MRALLOC_DEVICE, or the
first active one). Prints EXPOSE <method> <size> <median µs> <min µs> <max µs>.

options:
  --iters N       operations per method, size and round (default 200)
  --rounds N      measured rounds, after one warm-up round (default 5)
  --bench         given by cargo bench: without MRALLOC_DEVICE, nothing runs (positional
                  arguments, cargo bench's filters, are then ignored)
  --list          lists nothing (these are not criterion benchmarks) and exits
  -h, --help      print this help
";

fn main() -> mralloc::Result<()> {
    let (mut iters, mut rounds) = (200usize, 5usize);
    let cli = common::command_line(USAGE, 0, |name, p| {
        match name {
            "iters" => iters = common::positive(p, name)?,
            "rounds" => rounds = common::positive(p, name)?,
            _ => return Ok(false),
        }
        Ok(true)
    });
    if cli.list {
        return Ok(());
    }
    if std::env::var("MRALLOC_DEVICE").is_err() && cli.bench {
        println!("exposure: needs an RDMA device; run scripts/bench-transfer");
        return Ok(());
    }
    let ctx = Options::default().open_device()?;
    let pd = Pd::new(&ctx)?;
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::MW_BIND;
    // Two heaps with the same rights: chunks without remote rights (the default), and chunks
    // registered with them (what `remote_whole_chunk` needs).
    let heap = Heap::builder().bind(&pd).access(access).build()?;
    // SAFETY: the chunk keys go to this process's own connection only, which writes into a
    // buffer nothing reads while the writes run.
    let wide = unsafe { Heap::builder().bind(&pd).access(access).remote_access_to_whole_chunks() }.build()?;
    let opts = Options {
        qp: QpOptions { remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ, ..Default::default() },
        ..Options::default()
    };
    let (x, _y) = Connection::pair(&pd, &opts)?;

    // samples[method][size] = one median per round
    let mut samples = vec![vec![Vec::new(); SIZES.len()]; METHODS.len()];
    // Round 0 warms up (first registrations, page-map and QP caches) and is not counted.
    for round in 0..=rounds {
        for (si, &n) in SIZES.iter().enumerate() {
            for (mi, &method) in METHODS.iter().enumerate() {
                let mut t = Vec::with_capacity(iters);
                match method {
                    "buffer" => {
                        let mut buf = heap.alloc(n)?;
                        for _ in 0..iters {
                            let s = Instant::now();
                            std::hint::black_box(buf.remote()?);
                            buf.revoke_remote()?;
                            t.push(s.elapsed().as_secs_f64() * 1e6);
                        }
                    }
                    "grant" => {
                        let mut buf = Some(heap.alloc(n)?);
                        for _ in 0..iters {
                            let s = Instant::now();
                            let g = x.grant(buf.take().expect("buffer"), Access::REMOTE_WRITE).map_err(|r| r.error)?;
                            std::hint::black_box(g.remote());
                            buf = Some(g.revoke().map_err(|r| r.error)?);
                            t.push(s.elapsed().as_secs_f64() * 1e6);
                        }
                    }
                    "whole_chunk" => {
                        let buf = wide.alloc(n)?;
                        for _ in 0..iters {
                            let s = Instant::now();
                            std::hint::black_box(buf.remote_whole_chunk()?);
                            t.push(s.elapsed().as_secs_f64() * 1e6);
                        }
                    }
                    _ => {
                        let src = wide.alloc(n)?;
                        let dst = wide.alloc(n)?;
                        let remote = dst.remote_whole_chunk()?;
                        for _ in 0..iters {
                            let s = Instant::now();
                            x.write(&src, &remote, 0)?;
                            t.push(s.elapsed().as_secs_f64() * 1e6);
                        }
                    }
                }
                if round > 0 {
                    samples[mi][si].push(median(&mut t));
                }
            }
        }
    }
    for (mi, method) in METHODS.iter().enumerate() {
        for (si, n) in SIZES.iter().enumerate() {
            let v = &mut samples[mi][si];
            let m = median(v);
            println!("EXPOSE {method} {n} {m:.2} {:.2} {:.2}", v[0], v[v.len() - 1]);
        }
    }
    Ok(())
}
