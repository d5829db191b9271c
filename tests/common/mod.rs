//! Shared helpers for the integration tests.
//!
//! Convention: every test that needs an RDMA device is `#[ignore = "needs an RDMA device: run
//! scripts/test"]`. Plain `cargo test` skips them and says so; `scripts/test` runs them with
//! `--ignored` inside the Soft-RoCE VM (or on a host that has a device).
#![allow(dead_code)]

pub mod hosts;
pub mod memlock;
pub mod model;
pub mod rails;
pub mod rdma_res;

#[allow(unused_imports)]
pub use hosts::{links, netdev_of, Link};
#[allow(unused_imports)]
pub use memlock::{drop_ipc_lock, memlock, run_in_child, set_memlock_soft, vm_pinned_kib};
#[allow(unused_imports)]
pub use rdma_res::{our_pdns, rdma_res, resources};

use std::time::Duration;

use mralloc::heap::Buffer;
use mralloc::transfer::{Options, QpOptions, SetupOptions};
use mralloc::verbs::{Access, ConnectOptions, Context, Cq, Pd, Qp, SendOp, SendWr};

pub const WAIT: Duration = Duration::from_secs(20);

/// Waits (asynchronously, polling every millisecond, at most `within`) until `done()` holds.
pub async fn until(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The device the test run was given (scripts/softroce sets MRALLOC_DEVICE).
pub fn device_name() -> String {
    std::env::var("MRALLOC_DEVICE")
        .expect("MRALLOC_DEVICE is not set: device tests run inside the Soft-RoCE VM; use scripts/test")
}

pub fn open() -> Context {
    let name = device_name();
    Context::open(&name).unwrap_or_else(|e| panic!("opening {name}: {e}"))
}

/// Connection options whose QPs let the peer do `access` (RDMA WRITE/READ/atomics) into this
/// side's memory. `Options::default()` grants the peer nothing.
pub fn rights(access: Access) -> Options {
    Options { qp: QpOptions { remote_access: access, ..Default::default() }, ..Options::default() }
}

/// Two RC queue pairs on one device, connected to each other, each with its own CQ. Each lets
/// the other WRITE, READ and use atomics on its memory (the verbs tests exercise all of them).
pub struct Loopback {
    pub ctx: Context,
    pub pd: Pd,
    pub cq_a: Cq,
    pub cq_b: Cq,
    pub a: Qp,
    pub b: Qp,
}

pub fn loopback() -> Loopback {
    let ctx = open();
    let pd = Pd::new(&ctx).expect("alloc PD");
    loopback_in(&ctx, &pd)
}

pub fn loopback_in(ctx: &Context, pd: &Pd) -> Loopback {
    let cq_a = Cq::new(ctx, 256).expect("create CQ a");
    let cq_b = Cq::new(ctx, 256).expect("create CQ b");
    let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let a = Qp::builder(pd, &cq_a, &cq_a).remote_access(all).build().expect("create QP a");
    let b = Qp::builder(pd, &cq_b, &cq_b).remote_access(all).build().expect("create QP b");
    let opts = ConnectOptions::default();
    a.connect(&b.endpoint(), &opts).expect("connect a -> b");
    b.connect(&a.endpoint(), &opts).expect("connect b -> a");
    Loopback { ctx: ctx.clone(), pd: pd.clone(), cq_a, cq_b, a, b }
}

/// A deterministic, position-dependent byte pattern (never constant, never periodic at 256).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Asserts equality byte by byte, reporting the first difference.
pub fn assert_bytes_eq(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!("{what}: first difference at byte {i} of {}: got {:#04x}, want {:#04x}", want.len(), got[i], want[i]);
    }
}

/// A small deterministic RNG for workloads (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Churns a heap: `ops` operations, at most `max_live` buffers, sizes 64 B..=`max_size`
/// (log-uniform). Returns (peak live bytes, mapped bytes at the end).
pub fn churn(heap: &mralloc::heap::Heap, ops: usize, max_live: usize, max_size: usize) -> (u64, u64) {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut live = Vec::new();
    let (mut cur, mut peak) = (0u64, 0u64);
    for _ in 0..ops {
        if live.len() < max_live && (live.is_empty() || rng.below(2) == 0) {
            let lg = 6 + rng.below((max_size.ilog2() - 6 + 1) as u64) as u32;
            let size = ((1usize << lg) + rng.below(1 << lg) as usize).clamp(64, max_size);
            let mut b = heap.alloc(size).expect("churn allocation");
            b[0] = 1;
            b[size - 1] = 2;
            cur += size as u64;
            peak = peak.max(cur);
            live.push(b);
        } else {
            let b = live.swap_remove(rng.below(live.len() as u64) as usize);
            cur -= b.len() as u64;
        }
    }
    drop(live);
    (peak, heap.stats().mapped_bytes)
}

/// Runs #[ignore]d test `name` of this test binary again as a child process with `env` set (the
/// child takes the other role of a two-process test), capturing its output.
pub fn spawn_self(name: &str, env: (&str, String)) -> std::process::Child {
    spawn_test(name, true, &[(env.0, &env.1)])
}

/// Runs test `name` of this test binary alone (one test thread) in a child process with `env`
/// set, capturing its output; `ignored` for an #[ignore]d (device) test.
pub fn spawn_test(name: &str, ignored: bool, env: &[(&str, &str)]) -> std::process::Child {
    let mut args = vec!["--exact", name, "--nocapture", "--test-threads=1"];
    if ignored {
        args.push("--ignored");
    }
    std::process::Command::new(std::env::current_exe().expect("test binary path"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning the child process")
}

/// Waits for a child from [`spawn_self`], prints its output prefixed (so its libtest summary is
/// not counted as ours), asserts success, and returns the output.
pub fn finish_child(child: std::process::Child, who: &str) -> String {
    let out = child.wait_with_output().expect("waiting for the peer process");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    for line in text.lines() {
        println!("  {who}| {line}");
    }
    assert!(out.status.success(), "{who} process failed");
    text
}

/// Retries `connect` for up to a minute while the peer process starts listening.
pub fn connect_retrying<T>(mut connect: impl FnMut() -> mralloc::Result<T>) -> T {
    let start = std::time::Instant::now();
    loop {
        match connect() {
            Ok(c) => return c,
            Err(_) if start.elapsed() < std::time::Duration::from_secs(60) => {
                std::thread::sleep(std::time::Duration::from_millis(200))
            }
            Err(e) => panic!("connecting to the peer process: {e}"),
        }
    }
}

/// The next failed client setup `listener` records (its own accept calls never return them):
/// waits at most a minute.
pub fn next_handshake_failure(listener: &mralloc::transfer::Listener) -> mralloc::transfer::HandshakeFailure {
    let start = std::time::Instant::now();
    loop {
        if let Some(f) = listener.take_handshake_failures().into_iter().next() {
            return f;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no failed handshake recorded within a minute");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits until `done()` holds, checking every millisecond; panics naming `what` after `limit`.
/// For conditions a test must reach before its next step (instead of a sleep that passes
/// vacuously when the machine is slow).
pub fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Bytes of the TCP setup exchange's fixed header (magic, version, kind, code, rights, two endpoints,
/// nonce, MAC, blob length: `src/transfer/setup/exchange.rs`); a `Hello` without a blob or a secret
/// is exactly this long. The wire format is the crate's own: tests that forge messages take a
/// real client's and change what they test.
pub const HELLO_LEN: usize = 4 + 2 + 1 + 1 + 1 + 32 + 32 + 32 + 32 + 4;

/// A well-formed `Hello`, as a real client (`Connection::connect`, no blob, no secret) sends it
/// first, captured on a plain TCP socket. The client then gives up (its connect fails).
pub fn captured_hello(pd: &mralloc::verbs::Pd) -> Vec<u8> {
    use std::io::Read;
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    let pd = pd.clone();
    let client = std::thread::spawn(move || {
        let opts = Options {
            setup: SetupOptions { connect_timeout: Duration::from_secs(2), ..Default::default() },
            ..Options::default()
        };
        mralloc::transfer::Connection::connect(addr, &pd, opts).map(drop)
    });
    let (mut s, _) = tcp.accept().unwrap();
    let mut hello = vec![0u8; HELLO_LEN];
    s.read_exact(&mut hello).unwrap();
    drop(s);
    assert!(client.join().unwrap().is_err(), "the client got no welcome");
    assert_eq!(&hello[..4], b"mRdx", "a connection message");
    hello
}

/// The `VmFlags` of the mapping holding `addr` (from /proc/self/smaps), e.g. `hg` for
/// `MADV_HUGEPAGE`.
#[allow(dead_code)]
pub fn vm_flags(addr: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                inside = lo <= addr && addr < hi;
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().map(str::to_string).collect();
            }
        }
    }
    panic!("no mapping holds {addr:#x}");
}

/// RDMA-WRITEs `src` into `dst` (exposed with a key of its own) and RDMA-READs `dst` back into
/// `back` (with their own lkeys), verifying both byte by byte.
pub fn write_read(lb: &Loopback, src: &Buffer, dst: Buffer, back: &Buffer, what: &str) {
    let n = src.len();
    assert!(dst.len() >= n && back.len() >= n);
    let dst = dst.expose().expect("dst exposed");
    let remote = dst.remote();
    let sge = [src.sge(..).expect("src sge")];
    // SAFETY: src/dst/back outlive the completions polled right after each post, and the CPU
    // does not touch them meanwhile.
    unsafe { lb.a.post_send(&[SendWr::new(1, &sge, SendOp::Write(remote.at(0, n as u64).unwrap()))]).unwrap() };
    lb.cq_a.next(WAIT).unwrap().ok().unwrap_or_else(|e| panic!("{what}: write: {e}"));
    assert_bytes_eq(&dst.to_vec()[..n], src, &format!("{what}: RDMA WRITE"));
    let sge = [back.sge(..n).expect("back sge")];
    // SAFETY: as above.
    unsafe { lb.a.post_send(&[SendWr::new(2, &sge, SendOp::Read(remote.at(0, n as u64).unwrap()))]).unwrap() };
    lb.cq_a.next(WAIT).unwrap().ok().unwrap_or_else(|e| panic!("{what}: read: {e}"));
    assert_bytes_eq(&back[..n], src, &format!("{what}: RDMA READ"));
}
