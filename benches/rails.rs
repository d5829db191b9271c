//! Striped WRITE bandwidth of a [`Rails`] group between two hosts, one rail against two (run by
//! `scripts/bench-transfer`'s `rails` part in two Soft-RoCE VMs linked twice,
//! `scripts/softroce --hosts 2 --links dual`, next to `ib_write_bw` on each link).
//!
//! ```text
//! rails server --addr IP:PORT --devices rxe0,rxe1 [--size BYTES]
//! rails client --addr IP:PORT --devices rxe0[,rxe1] [--size BYTES] [--iters N] [--mark PREFIX]
//! rails stop   --addr IP:PORT --devices rxe0
//! ```
//! The server listens with a [`RailsListener`] (rail `i` on the `i`-th device), exposes one
//! `--size` buffer of a heap bound to every device and sends its [`RemoteDesc`] (a key per
//! device) with each group's setup; it serves one group after another until a `stop` client
//! comes. A client makes a group over its devices (as many rails as it names), WRITEs its own
//! `--size` buffer to the server's, whole, `--iters` times — each one [`Rails::post_write`] then
//! [`Striped::wait`](mralloc::transfer::Striped::wait), so one transfer is in flight at a time
//! and the group's slices and per-rail window are all that overlap — and prints
//! `RAILS <rails> <MiB/s> <bytes on rail 0> [<bytes on rail 1> ...]`, the bandwidth from the first
//! post to the last completion. With `--mark PREFIX` it creates the files `PREFIX`start and
//! `PREFIX`stop as that timing starts and stops (scripts/bench-transfer samples the CPU use of
//! both hosts between them). Everything is the crate's defaults but the connection's
//! operation timeout (60 s: TCG is slow): 256 KiB slices, a 4 MiB window per rail, waits that
//! poll up to 200 µs and then sleep on the completion channel.
//!
//! Under `cargo bench` (`--bench`) without a role nothing runs; `--list` lists nothing.

mod common;

use std::time::{Duration, Instant};

use mralloc::heap::Heap;
use mralloc::transfer::{Options, QpOptions, RailOptions, Rails, RailsListener, WaitOptions};
use mralloc::verbs::{Access, Context, Pd};
use mralloc::{Error, RemoteDesc};

const USAGE: &str = "\
usage: rails <server|client|stop> --addr IP:PORT --devices DEV[,DEV...] [--size BYTES] [--iters N]
             [--mark PREFIX]

Striped WRITE bandwidth of a rail group between two hosts (scripts/bench-transfer runs it in
two Soft-RoCE VMs linked twice).

roles:
  server   listen on --addr (rail i on the i-th device), expose one --size buffer, serve groups
           until a stop client comes
  client   a group over the devices given (one rail each), --iters WRITEs of --size bytes
           striped over it; prints RAILS <rails> <MiB/s> <bytes per rail...>
  stop     tell the server to stop

options:
  --addr IP:PORT     the server's rail 0 address
  --devices LIST     RDMA devices, comma-separated, rail 0 first
  --size BYTES       the buffer written (default 67108864)
  --iters N          client: WRITEs of the whole buffer (default 4)
  --mark PREFIX      client: create PREFIXstart and PREFIXstop as the timing starts and stops
  --bench            given by cargo bench: without a role, nothing runs
  --list             lists nothing (these are not criterion benchmarks) and exits
  -h, --help         print this help
";

struct Args {
    role: String,
    addr: String,
    devices: Vec<String>,
    size: usize,
    iters: usize,
    mark: Option<String>,
}

fn options() -> RailOptions {
    RailOptions {
        conn: Options {
            qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() },
            wait: WaitOptions { op_timeout: Duration::from_secs(60), ..Default::default() },
            ..Options::default()
        },
        ..RailOptions::default()
    }
}

/// A protection domain per device and a heap bound to all of them.
fn setup(devices: &[String]) -> mralloc::Result<(Vec<Pd>, Heap)> {
    let pds = devices.iter().map(|d| Pd::new(&Context::open(d)?)).collect::<mralloc::Result<Vec<_>>>()?;
    let heap = pds.iter().fold(Heap::builder().access(Access::ALL_REMOTE), |b, pd| b.bind(pd)).build()?;
    Ok((pds, heap))
}

/// A group to the server, retried for a minute while it is not up yet.
fn connect(a: &Args, pds: &[Pd]) -> mralloc::Result<Rails> {
    let start = Instant::now();
    loop {
        match Rails::connect(a.addr.as_str(), pds, options()) {
            Ok(r) => return Ok(r),
            Err(e) if start.elapsed() < Duration::from_secs(60) => {
                eprintln!("rails: connecting to {}: {e}; again", a.addr);
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => return Err(e),
        }
    }
}

fn word(heap: &Heap, rails: &Rails, w: &[u8]) -> mralloc::Result<()> {
    let mut b = heap.alloc(w.len())?;
    b.copy_from_slice(w);
    rails.send(&b)
}

fn server(a: &Args) -> mralloc::Result<()> {
    let (pds, heap) = setup(&a.devices)?;
    let inbox = heap.alloc(a.size)?.expose()?;
    inbox.write_from(0, &vec![0; a.size])?;
    let desc = inbox.desc()?;
    let listener = RailsListener::bind(a.addr.as_str(), &pds, options())?;
    println!("RAILS-SERVER listening on {} with {} devices, {} keys", a.addr, pds.len(), desc.keys().len());
    let mut msg = heap.alloc(16)?;
    loop {
        let rails = listener.accept_with(&desc.to_vec())?;
        let got = rails.recv(&mut msg)?;
        match &msg[..got.len] {
            b"done" => println!("RAILS-SERVER served a group of {} rails", rails.len()),
            b"stop" => break,
            w => return Err(Error::Protocol(format!("rails bench: unexpected word {w:?}"))),
        }
    }
    println!("RAILS-SERVER stopped");
    Ok(())
}

fn client(a: &Args) -> mralloc::Result<()> {
    let (pds, heap) = setup(&a.devices)?;
    let rails = connect(a, &pds)?;
    let n = rails.len();
    if n != pds.len() {
        return Err(Error::Protocol(format!("a group of {n} rails, {} asked for", pds.len())));
    }
    let remote = RemoteDesc::from_bytes(rails.peer_blob())?;
    let mut src = heap.alloc(a.size)?;
    src.fill(0x5a);
    let mut per_rail = vec![0u64; n];
    mark(a, "start")?;
    let t = Instant::now();
    for _ in 0..a.iters {
        let done = rails.post_write(src, &remote, 0)?.wait();
        let (mut bufs, reports) = done.into_result()?;
        src = bufs.pop().expect("the buffer written");
        for r in &reports {
            if let Some(e) = &r.failure {
                return Err(Error::Protocol(format!("rail {} ({}) failed: {e}", r.rail, r.device)));
            }
            per_rail[r.rail] += r.bytes;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    mark(a, "stop")?;
    let total = (a.size * a.iters) as u64;
    if per_rail.iter().sum::<u64>() != total || per_rail.contains(&0) {
        return Err(Error::Protocol(format!("{total} bytes written, per rail {per_rail:?}")));
    }
    let bytes: Vec<String> = per_rail.iter().map(u64::to_string).collect();
    println!("RAILS {n} {:.2} {}", total as f64 / secs / (1u64 << 20) as f64, bytes.join(" "));
    word(&heap, &rails, b"done")
}

/// Creates the file `--mark` names with `what` appended, if asked to.
fn mark(a: &Args, what: &str) -> mralloc::Result<()> {
    let Some(prefix) = &a.mark else { return Ok(()) };
    let path = format!("{prefix}{what}");
    std::fs::write(&path, what).map_err(|source| Error::Io { what: format!("writing {path}"), source })
}

fn stop(a: &Args) -> mralloc::Result<()> {
    let (pds, heap) = setup(&a.devices)?;
    let rails = connect(a, &pds)?;
    word(&heap, &rails, b"stop")
}

fn main() -> mralloc::Result<()> {
    let mut a =
        Args { role: String::new(), addr: String::new(), devices: Vec::new(), size: 64 << 20, iters: 4, mark: None };
    let cli = common::command_line(USAGE, 1, |name, p| {
        match name {
            "addr" => a.addr = common::text(p)?,
            "devices" => a.devices = common::text(p)?.split(',').map(String::from).collect(),
            "size" => a.size = common::positive(p, name)?,
            "iters" => a.iters = common::positive(p, name)?,
            "mark" => a.mark = Some(common::text(p)?),
            _ => return Ok(false),
        }
        Ok(true)
    });
    if cli.list {
        return Ok(());
    }
    a.role = cli.positional.first().cloned().unwrap_or_default();
    if cli.bench && a.role.is_empty() {
        println!("rails: needs a role and two linked hosts; run scripts/bench-transfer");
        return Ok(());
    }
    if a.addr.is_empty() || a.devices.is_empty() || a.devices.iter().any(String::is_empty) {
        common::usage_error(USAGE, "--addr and --devices are needed");
    }
    match a.role.as_str() {
        "server" => server(&a),
        "client" => client(&a),
        "stop" => stop(&a),
        r => common::usage_error(USAGE, &format!("unknown role {r:?} (server, client or stop)")),
    }
}
