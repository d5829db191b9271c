//! Real programs on well-known crates, shared by the four `workloads_*` bench binaries: the same
//! program with a different `#[global_allocator]` (mralloc's `Global`, unbound; tikv-jemallocator;
//! mimalloc; none, i.e. glibc), so their figures compare allocators, not programs.
//! `scripts/bench-alloc` runs the four interleaved and prints the ratios.
//!
//!     workloads_<who> <json|strings|threads>...
//!
//! Each workload is set up (its input generated), warmed up once at 1/8 of its size, then run
//! once, timed; the program prints `WORKLOAD <name> <seconds> <peak_rss_mib>`. The peak is the
//! kernel's high-water mark of resident memory (`VmHWM`), reset to the current RSS just before the
//! timed run (`5` to `/proc/self/clear_refs`), so it covers the timed run, including what the
//! allocator kept from the setup and the warm-up, and not the setup's own peak.
//!
//! - `json`: serde_json round trip of a generated ~40 MB document (160k objects with strings,
//!   numbers, booleans, arrays and nested objects): parse into `serde_json::Value`, serialize
//!   back, check the text is the same, drop both.
//! - `strings`: many small strings: a `HashMap<String, Vec<String>>` of 500k keys filled with
//!   1.5M pairs (values appended, so the vectors grow), then its keys sorted and everything
//!   dropped.
//! - `threads`: a request/response service on 2 threads over std channels: the client sends
//!   batches of 32 `Vec<u8>` requests (16 B - 16 KiB, mostly small; 400k in all), the server
//!   turns each into a `Vec<String>` response and frees the requests; the client keeps the
//!   responses in a window of 64Ki live entries (a replaced one is freed). Every buffer, and
//!   every batch, is freed by the other thread than the one that allocated it.
//!
//! Sizes are chosen for ~0.5-2 s per run on a 2-core machine.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::mpsc;
use std::time::Instant;

use serde_json::Value;

/// xorshift64: the workloads' deterministic inputs.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const WORDS: [&str; 16] = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo", "lima",
    "mike", "november", "oscar", "papa",
];

/// A workload: `setup(scale)` builds its input (outside the timing), `run` is what is timed.
trait Workload {
    fn setup(scale: usize) -> Self;
    fn run(self);
}

// --- json ---------------------------------------------------------------------------------------

/// The document, compact, its keys sorted (`Value`'s map is a `BTreeMap`): a round trip gives back
/// the same text.
struct Json(String);

impl Workload for Json {
    fn setup(scale: usize) -> Self {
        // Written as text directly (not through a `Value`), so that the setup leaves no freed
        // tree behind in the allocator: one string, reserved once.
        let mut rng = Rng::new(1);
        let mut word = || WORDS[rng.below(16) as usize];
        let mut rng2 = Rng::new(2);
        let mut doc = String::with_capacity(scale * 320);
        doc.push_str(r#"{"records":["#);
        for i in 0..scale {
            let n = rng2.next();
            if i > 0 {
                doc.push(',');
            }
            // Keys in sorted order, compact, as serde_json prints them.
            write!(doc, r#"{{"active":{},"#, n % 3 == 0).unwrap();
            let (city, street) = (word(), word());
            write!(
                doc,
                r#""address":{{"city":"{city}","street":"{} {street} street","zip":{}}},"#,
                n % 997,
                n % 100_000
            )
            .unwrap();
            write!(doc, r#""email":"{}.{}@example.com","history":["#, word(), n % 9973).unwrap();
            for k in 0..(n >> 8) % 4 {
                let sep = if k > 0 { "," } else { "" };
                write!(doc, r#"{sep}{{"t":{},"v":{}}}"#, 1_700_000_000 + k * 60, (n >> 16) % 1000).unwrap();
            }
            // The score has at most 6 significant digits: parsed exactly, printed back the same.
            let (first, last) = (word(), word());
            write!(
                doc,
                r#"],"id":{i},"name":"{first} {last}-{}","score":{},"tags":["#,
                n % 100_000,
                (n % 1_000_000) as f64 / 100.0
            )
            .unwrap();
            for k in 0..n % 5 {
                let sep = if k > 0 { "," } else { "" };
                write!(doc, r#"{sep}"{}""#, word()).unwrap();
            }
            doc.push_str("]}");
        }
        doc.push_str(r#"],"version":1}"#);
        Json(doc)
    }

    fn run(self) {
        let doc = self.0;
        let value: Value = serde_json::from_str(&doc).unwrap();
        let back = serde_json::to_string(&value).unwrap();
        assert_eq!(back.len(), doc.len(), "json: the round trip changed the document's length");
        assert!(back == doc, "json: the round trip changed the document");
        drop(value);
    }
}

// --- strings ------------------------------------------------------------------------------------

struct Strings {
    keys: usize,
    pairs: usize,
}

impl Workload for Strings {
    fn setup(scale: usize) -> Self {
        Strings { keys: scale, pairs: 3 * scale }
    }

    fn run(self) {
        let mut rng = Rng::new(3);
        let mut map: HashMap<String, Vec<String>> = HashMap::new();
        for _ in 0..self.pairs {
            let k = rng.below(self.keys as u64);
            let key = format!("{}-{k:x}", WORDS[(k % 16) as usize]);
            let v = rng.next();
            let value = format!("{}:{}", WORDS[(v % 16) as usize], v >> 40);
            map.entry(key).or_default().push(value);
        }
        let values: usize = map.values().map(Vec::len).sum();
        assert_eq!(values, self.pairs);
        let mut keys: Vec<String> = map.into_keys().collect();
        keys.sort_unstable();
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
        std::hint::black_box(&keys);
    }
}

// --- threads ------------------------------------------------------------------------------------

struct Threads {
    requests: usize,
}

/// Requests per message (a `Vec` of them, itself allocated by one thread and freed by the other).
const BATCH: usize = 32;
/// Messages in flight (the channels' capacity: neither side ever blocks the other for good).
const IN_FLIGHT: usize = 8;
/// Responses the client keeps live.
const WINDOW: u64 = 1 << 16;

type Requests = Vec<(u64, Vec<u8>)>;
type Responses = Vec<(u64, Vec<String>)>;

fn request_size(x: u64) -> usize {
    // 3/4 small (16-512 B), 1/4 larger (512 B - 16 KiB).
    if x % 4 != 0 {
        16 + (x >> 8) as usize % 496
    } else {
        512 + (x >> 8) as usize % (16 << 10)
    }
}

/// The server: each request becomes a few strings (one per 256 bytes: a checksum); the requests
/// are freed here, on the other thread than the one that allocated them.
fn serve(requests: mpsc::Receiver<Requests>, responses: mpsc::SyncSender<Responses>) {
    for batch in requests {
        let mut out = Vec::with_capacity(batch.len());
        for (id, req) in batch {
            let mut strings = Vec::with_capacity(1);
            for chunk in req.chunks(256) {
                let sum = chunk.iter().fold(0u32, |a, &b| a.wrapping_mul(31).wrapping_add(b as u32));
                let mut s = String::new();
                write!(s, "{id:x}/{}:{sum:08x}", chunk.len()).unwrap();
                strings.push(s);
            }
            out.push((id, strings));
        }
        if responses.send(out).is_err() {
            return;
        }
    }
}

impl Workload for Threads {
    fn setup(scale: usize) -> Self {
        Threads { requests: scale.div_ceil(BATCH) * BATCH }
    }

    fn run(self) {
        let (req_tx, req_rx) = mpsc::sync_channel::<Requests>(IN_FLIGHT);
        let (resp_tx, resp_rx) = mpsc::sync_channel::<Responses>(IN_FLIGHT);
        let server = std::thread::spawn(move || serve(req_rx, resp_tx));
        let client = std::thread::spawn(move || {
            let mut rng = Rng::new(4);
            let mut next_id = 0u64;
            let mut batch = || -> Requests {
                (0..BATCH)
                    .map(|_| {
                        let x = rng.next();
                        next_id += 1;
                        (next_id, vec![x as u8; request_size(x)])
                    })
                    .collect()
            };
            let batches = self.requests / BATCH;
            let mut window: HashMap<u64, Vec<String>> = HashMap::new();
            let mut sent = 0;
            while sent < IN_FLIGHT.min(batches) {
                req_tx.send(batch()).unwrap();
                sent += 1;
            }
            let mut strings = 0usize;
            for _ in 0..batches {
                // Replaces (frees) responses to earlier requests: allocated by the server.
                for (id, resp) in resp_rx.recv().unwrap() {
                    strings += resp.len();
                    window.insert(id % WINDOW, resp);
                }
                if sent < batches {
                    req_tx.send(batch()).unwrap();
                    sent += 1;
                }
            }
            drop(req_tx);
            strings
        });
        let strings = client.join().unwrap();
        server.join().unwrap();
        assert!(strings >= self.requests);
    }
}

// --- driver -------------------------------------------------------------------------------------

/// Resident memory's high-water mark (`VmHWM`) in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/self/status");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Resets `VmHWM` to the current RSS (Linux 4.0+); says so on stderr if it cannot.
fn reset_peak_rss() {
    if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
        eprintln!("workloads: cannot reset the peak RSS ({e}): it covers the whole process");
    }
}

fn measure<W: Workload>(name: &str, scale: usize) {
    // Warm-up: code, page tables, the allocator's caches and the first chunks, at 1/8 size.
    W::setup(scale / 8).run();
    let w = W::setup(scale);
    reset_peak_rss();
    let t = Instant::now();
    w.run();
    let secs = t.elapsed().as_secs_f64();
    println!("WORKLOAD {name} {secs:.4} {:.1}", peak_rss() as f64 / 1048576.0);
}

/// Runs the workloads named on the command line (`cargo bench` runs every bench binary with
/// `--bench` alone: nothing to do then).
pub fn main(who: &str) {
    let names: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    if names.is_empty() {
        return;
    }
    for name in &names {
        match name.as_str() {
            "json" => measure::<Json>("json", 160_000),
            "strings" => measure::<Strings>("strings", 500_000),
            "threads" => measure::<Threads>("threads", 400_000),
            _ => {
                eprintln!("usage: workloads_{who} <json|strings|threads>...");
                std::process::exit(2);
            }
        }
    }
}
