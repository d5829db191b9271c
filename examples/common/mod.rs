//! Helpers the examples share: arguments, spawning the other roles, CRC-32, a progress line.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `--key value` pairs and bare words (the role).
pub struct Args {
    pub role: Option<String>,
    kv: HashMap<String, String>,
}

impl Args {
    pub fn parse() -> Args {
        let mut role = None;
        let mut kv = HashMap::new();
        let mut it = std::env::args().skip(1).peekable();
        while let Some(a) = it.next() {
            if let Some(k) = a.strip_prefix("--") {
                let v = match it.peek() {
                    Some(v) if !v.starts_with("--") => it.next().unwrap_or_default(),
                    _ => "true".to_string(),
                };
                kv.insert(k.to_string(), v);
            } else if role.is_none() {
                role = Some(a);
            }
        }
        Args { role, kv }
    }

    /// Arguments given directly (e.g. derived from the environment).
    pub fn with(role: &str, pairs: &[(&str, String)]) -> Args {
        Args { role: Some(role.into()), kv: pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect() }
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.kv.get(k).map(String::as_str)
    }

    /// A numeric argument with a default; exits with a message if it does not parse.
    pub fn num(&self, k: &str, default: usize) -> usize {
        match self.get(k) {
            None => default,
            Some(v) => v.parse().unwrap_or_else(|_| fail(&format!("--{k} {v}: not a number"))),
        }
    }

    pub fn str_or(&self, k: &str, default: &str) -> String {
        self.get(k).unwrap_or(default).to_string()
    }
}

pub fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1)
}

/// A free TCP port on the loopback interface (for the roles this example starts itself).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(47000)
}

/// Starts this same example as another role, with `args`; its output is prefixed with the role.
pub fn spawn_role(role: &str, args: &[String]) -> Child {
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(&format!("locating this example: {e}")));
    let mut child = Command::new(exe)
        .arg(role)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| fail(&format!("starting the {role} process: {e}")));
    let out = child.stdout.take().expect("piped stdout");
    let tag = role.to_string();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            println!("[{tag}] {line}");
        }
    });
    child
}

/// Waits for the roles this example started; fails if any failed.
pub fn wait_all(children: Vec<(String, Child)>) {
    for (role, mut c) in children {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => fail(&format!("the {role} process failed ({s})")),
            Err(e) => fail(&format!("waiting for the {role} process: {e}")),
        }
    }
}

/// Retries `f` for up to 60 s while a peer starts listening.
pub fn retry<T>(mut f: impl FnMut() -> mralloc::Result<T>) -> mralloc::Result<T> {
    let start = Instant::now();
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(_) if start.elapsed() < Duration::from_secs(60) => std::thread::sleep(Duration::from_millis(150)),
            Err(e) => return Err(e),
        }
    }
}

/// CRC-32 (IEEE 802.3, as zlib), table-driven.
pub fn crc32(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        std::array::from_fn(|i| (0..8).fold(i as u32, |c, _| if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 }))
    });
    !data.iter().fold(!0u32, |c, &b| t[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8))
}

/// A one-line progress bar on stderr (only when it is a terminal).
pub struct Progress {
    total: u64,
    start: Instant,
    tty: bool,
}

impl Progress {
    pub fn new(total: u64) -> Progress {
        // SAFETY: isatty has no preconditions.
        let tty = unsafe { libc::isatty(2) } == 1;
        Progress { total, start: Instant::now(), tty }
    }

    pub fn update(&self, done: u64) {
        if !self.tty {
            return;
        }
        let frac = done as f64 / self.total.max(1) as f64;
        let filled = (frac * 30.0) as usize;
        let mibs = done as f64 / self.start.elapsed().as_secs_f64().max(1e-9) / (1u64 << 20) as f64;
        eprint!("\r[{}{}] {:5.1}% {:8.1} MiB/s", "#".repeat(filled), " ".repeat(30 - filled), frac * 100.0, mibs);
        let _ = std::io::stderr().flush();
    }

    pub fn finish(&self) {
        if self.tty {
            eprintln!();
        }
    }
}

/// A PD on `device` (default: MRALLOC_DEVICE or the first active device) and a heap bound to it
/// with `access`.
pub fn setup_on(
    device: Option<&str>,
    access: mralloc::verbs::Access,
) -> mralloc::Result<(mralloc::verbs::Pd, mralloc::heap::Heap)> {
    let opts = mralloc::transfer::Options { device: device.map(str::to_owned), ..Default::default() };
    let pd = mralloc::verbs::Pd::new(&opts.open_device()?)?;
    let heap = mralloc::heap::Heap::builder().bind(&pd).access(access).build()?;
    Ok((pd, heap))
}

/// Deterministic bytes for example data sets.
pub fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

#[test]
fn crc32_known_value() {
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
}

/// On a host started by `scripts/softroce --hosts N`: (local device, local IP, peer IP) of the
/// link to host `peer`, from MRALLOC_LINKS.
pub fn link_to(peer: usize) -> Option<(String, String, String)> {
    let spec = std::env::var("MRALLOC_LINKS").ok()?;
    spec.split_whitespace().find_map(|e| {
        let f: Vec<&str> = e.split(':').collect();
        (f.len() == 4 && f[0].parse() == Ok(peer)).then(|| (f[1].to_string(), f[2].to_string(), f[3].to_string()))
    })
}
