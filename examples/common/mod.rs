//! Helpers the examples share: the command line (lexopt), spawning the other roles, a progress bar
//! (indicatif), latency percentiles (hdrhistogram).
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// What an example accepts on its command line: at most one role (a bare word), and options.
/// `--help`/`-h` prints [`Spec::usage`]; anything not declared here is an error.
pub struct Spec {
    /// The example's name, as in `cargo run --example NAME`.
    pub name: &'static str,
    /// What it does, in a line or two.
    pub about: &'static str,
    /// What runs when no role is given (unused when there are no roles).
    pub no_role: &'static str,
    /// The roles: (word, what that process does).
    pub roles: &'static [(&'static str, &'static str)],
    pub opts: &'static [Opt],
}

/// In [`Opt::roles`]: the run without a role.
pub const NO_ROLE: &str = "";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Text,
    Num,
    Port,
    Flag,
}

/// One `--name VALUE` option (or a `--name` flag) of a [`Spec`].
#[derive(Clone, Copy)]
pub struct Opt {
    name: &'static str,
    kind: Kind,
    value: &'static str,
    help: &'static str,
    roles: &'static [&'static str],
}

impl Opt {
    /// `--name VALUE`: a non-negative integer.
    pub const fn num(name: &'static str, value: &'static str, help: &'static str) -> Opt {
        Opt { name, kind: Kind::Num, value, help, roles: &[] }
    }

    /// `--name PORT`: a TCP port number (0-65535).
    pub const fn port(name: &'static str, help: &'static str) -> Opt {
        Opt { name, kind: Kind::Port, value: "PORT", help, roles: &[] }
    }

    /// `--name VALUE`: any text.
    pub const fn text(name: &'static str, value: &'static str, help: &'static str) -> Opt {
        Opt { name, kind: Kind::Text, value, help, roles: &[] }
    }

    /// `--name`, without a value.
    pub const fn flag(name: &'static str, help: &'static str) -> Opt {
        Opt { name, kind: Kind::Flag, value: "", help, roles: &[] }
    }

    /// Accepted only with these roles ([`NO_ROLE`]: without a role); by default with all of them.
    pub const fn roles(self, roles: &'static [&'static str]) -> Opt {
        Opt { roles, ..self }
    }

    fn applies(&self, role: Option<&str>) -> bool {
        self.roles.is_empty() || self.roles.contains(&role.unwrap_or(NO_ROLE))
    }

    fn left(&self) -> String {
        match self.kind {
            Kind::Flag => format!("--{}", self.name),
            _ => format!("--{} {}", self.name, self.value),
        }
    }
}

/// Why [`Spec::try_parse`] returned no arguments to run with.
#[derive(Debug, PartialEq, Eq)]
pub enum Stop {
    /// `--help` or `-h`.
    Help,
    /// What is wrong with the command line.
    Error(String),
}

fn lexopt_error(e: lexopt::Error) -> Stop {
    Stop::Error(e.to_string())
}

fn role_list(roles: &[&str]) -> String {
    roles.iter().map(|r| if r.is_empty() { "no role" } else { *r }).collect::<Vec<_>>().join(", ")
}

impl Spec {
    /// Parses `args` (without the program name) as this spec declares.
    pub fn try_parse<I>(&'static self, args: I) -> Result<Args, Stop>
    where
        I: IntoIterator,
        I::Item: Into<OsString>,
    {
        use lexopt::prelude::*;
        let mut p = lexopt::Parser::from_args(args);
        let mut role: Option<String> = None;
        let mut kv = HashMap::new();
        while let Some(arg) = p.next().map_err(lexopt_error)? {
            match arg {
                Short('h') | Long("help") => return Err(Stop::Help),
                Long(name) => {
                    let name = name.to_string();
                    let Some(opt) = self.opts.iter().find(|o| o.name == name) else {
                        return Err(Stop::Error(format!("unknown option --{name}")));
                    };
                    let v = match opt.kind {
                        Kind::Flag => "true".to_string(),
                        _ => p.value().map_err(lexopt_error)?.string().map_err(lexopt_error)?,
                    };
                    let bad = match opt.kind {
                        Kind::Num => v.parse::<usize>().is_err().then_some("not a number"),
                        Kind::Port => v.parse::<u16>().is_err().then_some("not a port number (0-65535)"),
                        Kind::Text | Kind::Flag => None,
                    };
                    if let Some(why) = bad {
                        return Err(Stop::Error(format!("--{name} {v}: {why}")));
                    }
                    kv.insert(name, v);
                }
                Value(v) => {
                    let v = v.string().map_err(lexopt_error)?;
                    if role.is_some() || self.roles.is_empty() {
                        return Err(Stop::Error(format!("unexpected argument {v:?}")));
                    }
                    if !self.roles.iter().any(|(r, _)| *r == v) {
                        let roles: Vec<&str> = self.roles.iter().map(|(r, _)| *r).collect();
                        return Err(Stop::Error(format!("unknown role {v:?} ({})", roles.join(" | "))));
                    }
                    role = Some(v);
                }
                other => return Err(lexopt_error(other.unexpected())),
            }
        }
        // The role may come after the options: check them against it now, in the spec's order.
        for o in self.opts.iter().filter(|o| kv.contains_key(o.name)) {
            if !o.applies(role.as_deref()) {
                let with = role.as_deref().map_or("without a role".to_string(), |r| format!("with role {r}"));
                return Err(Stop::Error(format!("--{} is not accepted {with} (only: {})", o.name, role_list(o.roles))));
            }
        }
        Ok(Args { role, kv, spec: Some(self) })
    }

    /// The usage text `--help` prints.
    pub fn usage(&self) -> String {
        let mut s = String::new();
        let roles: Vec<&str> = self.roles.iter().map(|(r, _)| *r).collect();
        let roles = if roles.is_empty() { String::new() } else { format!(" [{}]", roles.join(" | ")) };
        let opts = if self.opts.is_empty() { "" } else { " [OPTIONS]" };
        s.push_str(&format!("usage: {}{roles}{opts}\n\n{}\n", self.name, self.about));
        if !self.roles.is_empty() {
            let w = self.roles.iter().map(|(r, _)| r.len()).chain(["(none)".len()]).max().unwrap_or(0);
            s.push_str("\nroles:\n");
            s.push_str(&format!("  {:w$}  {}\n", "(none)", self.no_role));
            for (r, help) in self.roles {
                s.push_str(&format!("  {r:w$}  {help}\n"));
            }
        }
        s.push_str("\noptions:\n");
        let w = self.opts.iter().map(|o| o.left().len()).chain(["-h, --help".len()]).max().unwrap_or(0);
        for o in self.opts {
            let only = if o.roles.is_empty() { String::new() } else { format!(" [{}]", role_list(o.roles)) };
            s.push_str(&format!("  {:w$}  {}{only}\n", o.left(), o.help));
        }
        s.push_str(&format!("  {:w$}  print this help\n", "-h, --help"));
        s
    }

    /// Exits with `error: <msg>` and the usage on stderr, status 2.
    pub fn usage_error(&self, msg: &str) -> ! {
        eprintln!("error: {msg}\n");
        eprint!("{}", self.usage());
        std::process::exit(2)
    }

    /// Whether `key` is an option of `role`.
    fn accepts(&self, key: &str, role: Option<&str>) -> bool {
        self.opts.iter().any(|o| o.name == key && o.applies(role))
    }
}

/// The role and the options of this run.
pub struct Args {
    pub role: Option<String>,
    kv: HashMap<String, String>,
    spec: Option<&'static Spec>,
}

impl Args {
    /// This process's command line, as `spec` declares it: `--help` prints the usage and exits 0;
    /// an unknown option or role, a missing value, an extra argument or a value that does not
    /// parse exits 2 with `error: ...` and the usage.
    pub fn parse(spec: &'static Spec) -> Args {
        match spec.try_parse(std::env::args_os().skip(1)) {
            Ok(args) => args,
            Err(Stop::Help) => {
                print!("{}", spec.usage());
                std::process::exit(0)
            }
            Err(Stop::Error(msg)) => spec.usage_error(&msg),
        }
    }

    /// Arguments given directly (e.g. derived from the environment).
    pub fn with(role: &str, pairs: &[(&str, String)]) -> Args {
        let kv = pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        Args { role: Some(role.into()), kv, spec: None }
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        debug_assert!(
            self.spec.is_none_or(|s| s.accepts(k, self.role.as_deref())),
            "the example reads --{k}, which its Spec does not declare for role {:?}",
            self.role
        );
        self.kv.get(k).map(String::as_str)
    }

    /// A numeric argument with a default (checked when parsed; for [`Args::with`], here).
    pub fn num(&self, k: &str, default: usize) -> usize {
        match self.get(k) {
            None => default,
            Some(v) => v.parse().unwrap_or_else(|_| self.usage_error(&format!("--{k} {v}: not a number"))),
        }
    }

    pub fn str_or(&self, k: &str, default: &str) -> String {
        self.get(k).unwrap_or(default).to_string()
    }

    /// Whether the flag `--k` was given.
    pub fn flag(&self, k: &str) -> bool {
        self.get(k).is_some()
    }

    /// A value the spec cannot check (e.g. a minimum): `error: <msg>`, the usage, status 2.
    pub fn usage_error(&self, msg: &str) -> ! {
        match self.spec {
            Some(spec) => spec.usage_error(msg),
            None => fail(msg),
        }
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

/// A progress bar for `total` bytes on stderr (bytes done, throughput, ETA), drawn only when
/// stderr is a terminal.
pub fn progress_bar(total: u64) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    use std::io::IsTerminal;
    let target =
        if std::io::stderr().is_terminal() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let style = ProgressStyle::with_template(
        "[{bar:30}] {percent:>3}% {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
    )
    .expect("a valid progress template")
    .progress_chars("#> ");
    ProgressBar::with_draw_target(Some(total), target).with_style(style)
}

/// An empty histogram of latencies in nanoseconds: 1 ns to 60 s, 3 significant digits.
pub fn latencies() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// Records `d` in a histogram from [`latencies`] (clamped to its range).
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    h.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
}

/// `p50 12.3 µs, p99 20.1 µs, max 25.0 µs, mean 13.0 µs` of a histogram from [`latencies`]; in
/// ms when the median is 1 ms or more.
pub fn percentiles(h: &Histogram<u64>) -> String {
    if h.is_empty() {
        return "no samples".into();
    }
    let (div, unit) = if h.value_at_quantile(0.5) >= 1_000_000 { (1e6, "ms") } else { (1e3, "µs") };
    let v = |ns: u64| ns as f64 / div;
    format!(
        "p50 {:.1} {unit}, p99 {:.1} {unit}, max {:.1} {unit}, mean {:.1} {unit}",
        v(h.value_at_quantile(0.5)),
        v(h.value_at_quantile(0.99)),
        v(h.max()),
        h.mean() / div
    )
}

/// A PD on `device` (default: MRALLOC_DEVICE or the first active device) and a heap bound to it
/// with `access`.
pub fn setup_on(
    device: Option<&str>,
    access: mralloc::verbs::Access,
) -> mralloc::Result<(mralloc::verbs::Pd, mralloc::heap::Heap)> {
    let opts = mralloc::transfer::Options {
        device: mralloc::transfer::DeviceChoice { name: device.map(str::to_owned), ..Default::default() },
        ..Default::default()
    };
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

/// On a host started by `scripts/softroce --hosts N`: (local device, local IP, peer IP) of the
/// link to host `peer`, from MRALLOC_LINKS.
pub fn link_to(peer: usize) -> Option<(String, String, String)> {
    let spec = std::env::var("MRALLOC_LINKS").ok()?;
    spec.split_whitespace().find_map(|e| {
        let f: Vec<&str> = e.split(':').collect();
        (f.len() == 4 && f[0].parse() == Ok(peer)).then(|| (f[1].to_string(), f[2].to_string(), f[3].to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    static SPEC: Spec = Spec {
        name: "demo",
        about: "A test spec.",
        no_role: "both roles",
        roles: &[("server", "serves"), ("client", "connects")],
        opts: &[
            Opt::num("size", "BYTES", "bytes"),
            Opt::port("port", "listening port").roles(&["server"]),
            Opt::text("addr", "HOST:PORT", "the server").roles(&[NO_ROLE, "client"]),
            Opt::flag("quiet", "say less"),
        ],
    };

    fn ok(args: &[&str]) -> Args {
        match SPEC.try_parse(args.iter().copied()) {
            Ok(a) => a,
            Err(e) => panic!("{args:?}: {e:?}"),
        }
    }

    fn err(args: &[&str]) -> String {
        match SPEC.try_parse(args.iter().copied()) {
            Err(Stop::Error(msg)) => msg,
            Err(Stop::Help) => panic!("{args:?}: help"),
            Ok(_) => panic!("{args:?} parsed"),
        }
    }

    #[test]
    fn declared_arguments_parse() {
        let a = ok(&["--size", "5", "server", "--port=7000", "--quiet"]);
        assert_eq!(a.role.as_deref(), Some("server"));
        assert_eq!((a.num("size", 1), a.num("port", 1), a.flag("quiet")), (5, 7000, true));
        let a = ok(&["--addr", "h:1"]);
        assert_eq!((a.role.as_deref(), a.str_or("addr", "x"), a.num("size", 9)), (None, "h:1".to_string(), 9));
        assert_eq!(ok(&["client", "--addr", "h:2"]).get("addr"), Some("h:2"));
    }

    #[test]
    fn help_stops() {
        assert_eq!(SPEC.try_parse(["--size", "1", "-h"]).err(), Some(Stop::Help));
        assert_eq!(SPEC.try_parse(["--help"]).err(), Some(Stop::Help));
        let usage = SPEC.usage();
        let words = ["--size BYTES", "--port PORT", "--addr HOST:PORT", "--quiet", "client", "[no role, client]"];
        for word in words {
            assert!(usage.contains(word), "{word} missing from\n{usage}");
        }
    }

    #[test]
    fn mistakes_are_errors() {
        assert!(err(&["--sise", "5"]).contains("--sise"));
        assert!(err(&["-x"]).contains("-x"));
        assert!(err(&["--size"]).contains("--size"));
        assert!(err(&["--size", "12x"]).contains("not a number"));
        assert!(err(&["server", "--port", "70000"]).contains("port"));
        assert!(err(&["bogus"]).contains("unknown role"));
        assert!(err(&["server", "extra"]).contains("extra"));
        assert!(err(&["--quiet=1"]).contains("--quiet"));
        // Options of other roles.
        assert!(err(&["client", "--port", "1"]).contains("--port"));
        assert!(err(&["--port", "1"]).contains("without a role"));
        assert!(err(&["server", "--addr", "h:1"]).contains("--addr"));
    }
}
