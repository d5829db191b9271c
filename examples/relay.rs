//! `relay`: the three-machine distribution scenario. A RDMA-WRITEs a data set into B's registered
//! memory and notifies it with the immediate (its CRC-32); B transforms it, checksums it and
//! forwards it to C by SEND (with the new CRC as immediate); C verifies against its own
//! computation. Three processes, per-stage timing printed.
//!
//! ```text
//! scripts/softroce -- cargo run --release --example relay -- [--size BYTES]   # all three roles
//! relay c --port 7482 --size N ; relay b --port 7481 --next C:7482 --size N ; relay a --addr B:7481 --size N
//! # on three VMs linked in a line (scripts/softroce --hosts 3 --links line): roles from MRALLOC_HOST
//! relay host --size N
//! ```

mod common;

use std::time::Instant;

use common::{fail, Args, Opt, Spec};
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, DeviceChoice, Listener, Options, QpOptions};
use mralloc::verbs::{Access, Pd};
use mralloc::RemoteBuf;

static SPEC: Spec = Spec {
    name: "relay",
    about: "A RDMA-WRITEs a data set into B with its CRC-32 as immediate; B transforms it and forwards it\n\
            to C by SEND; C verifies it against its own computation. Per-stage timing.",
    no_role: "all three roles in this command (child processes)",
    roles: &[
        ("a", "write the data set into B at --addr"),
        ("b", "listen on --port for A, forward to C at --next"),
        ("c", "listen on --port for B, verify"),
        ("host", "on 3 linked VMs (scripts/softroce --hosts 3 --links line): A, B or C by MRALLOC_HOST"),
    ],
    opts: &[
        Opt::num("size", "BYTES", "bytes relayed (default 16777216 = 16 MiB); the same on every process of a run"),
        Opt::text("addr", "HOST:PORT", "B (default 127.0.0.1:7481)").roles(&["a"]),
        Opt::text("next", "HOST:PORT", "C (default 127.0.0.1:7482)").roles(&["b"]),
        Opt::text("bind", "IP", "the address to listen on (default 0.0.0.0)").roles(&["b", "c"]),
        Opt::port("port", "the port to listen on (default 7481 for b, 7482 for c)").roles(&["b", "c"]),
        Opt::text("device", "NAME", "the RDMA device (default MRALLOC_DEVICE or the first active one)")
            .roles(&["a", "c"]),
        Opt::text("device-in", "NAME", "the RDMA device towards A (default MRALLOC_DEVICE or the first active one)")
            .roles(&["b"]),
        Opt::text("device-out", "NAME", "the RDMA device towards C (default: the one towards A)").roles(&["b"]),
    ],
};

/// What B does to the data on the way through.
fn transform(b: &mut [u8]) {
    for (i, x) in b.iter_mut().enumerate() {
        *x = x.wrapping_mul(3).wrapping_add(i as u8);
    }
}

fn main() {
    let args = Args::parse(&SPEC);
    let r = match args.role.as_deref() {
        Some("a") => a(&args),
        Some("b") => b(&args),
        Some("c") => c(&args),
        Some("host") => host(&args),
        None => all(&args),
        Some(other) => fail(&format!("unknown role {other} (a | b | c)")),
    };
    if let Err(e) = r {
        fail(&format!("relay: {e}"));
    }
}

fn all(args: &Args) -> mralloc::Result<()> {
    let size = args.num("size", 16 << 20).to_string();
    let (pb, pc) = (common::free_port(), common::free_port());
    let c = common::spawn_role("c", &["--port".into(), pc.to_string(), "--size".into(), size.clone()]);
    let b = common::spawn_role(
        "b",
        &["--port".into(), pb.to_string(), "--next".into(), format!("127.0.0.1:{pc}"), "--size".into(), size.clone()],
    );
    let a = common::spawn_role("a", &["--addr".into(), format!("127.0.0.1:{pb}"), "--size".into(), size]);
    common::wait_all(vec![("a".into(), a), ("b".into(), b), ("c".into(), c)]);
    println!("relay: OK");
    Ok(())
}

/// Host 0, 1, 2 of a linked-VM line become A, B, C; addresses and devices come from the links.
fn host(args: &Args) -> mralloc::Result<()> {
    let me: usize = std::env::var("MRALLOC_HOST")
        .ok()
        .and_then(|h| h.parse().ok())
        .unwrap_or_else(|| fail("MRALLOC_HOST is not set"));
    let link = |peer| common::link_to(peer).unwrap_or_else(|| fail(&format!("host {me} has no link to host {peer}")));
    let size = ("size", args.num("size", 16 << 20).to_string());
    match me {
        0 => {
            let (dev, _, b_ip) = link(1);
            a(&Args::with("a", &[("addr", format!("{b_ip}:7481")), ("device", dev), size]))
        }
        1 => {
            let ((dev_in, ip_in, _), (dev_out, _, c_ip)) = (link(0), link(2));
            b(&Args::with(
                "b",
                &[
                    ("bind", ip_in),
                    ("port", "7481".into()),
                    ("device-in", dev_in),
                    ("next", format!("{c_ip}:7482")),
                    ("device-out", dev_out),
                    size,
                ],
            ))
        }
        2 => {
            let (dev, ip, _) = link(1);
            c(&Args::with("c", &[("bind", ip), ("port", "7482".into()), ("device", dev), size]))
        }
        _ => fail("relay runs on 3 hosts"),
    }
}

fn pd_on(device: Option<&str>) -> mralloc::Result<Pd> {
    let opts = Options {
        device: DeviceChoice { name: device.map(str::to_owned), ..Default::default() },
        ..Options::default()
    };
    Pd::new(&opts.open_device()?)
}

fn opts_on(device: Option<&str>) -> Options {
    Options { device: DeviceChoice { name: device.map(str::to_owned), ..Default::default() }, ..Options::default() }
}

fn a(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(args.get("device"), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let size = args.num("size", 16 << 20);
    let mut data = heap.alloc(size)?;
    data.copy_from_slice(&common::data(42, size));
    let crc = crc32fast::hash(&data);
    let addr = args.str_or("addr", "127.0.0.1:7481");
    let conn = common::retry(|| Connection::connect(addr.as_str(), &pd, opts_on(args.get("device"))))?;
    let landing = RemoteBuf::from_bytes(conn.peer_blob())?;
    let t = Instant::now();
    conn.write_with_imm(&data, &landing, 0, crc)?;
    let s = t.elapsed().as_secs_f64();
    println!(
        "A: wrote {size} bytes into B with write-with-imm (CRC {crc:08x}) in {:.1} ms ({:.1} MiB/s)",
        s * 1e3,
        size as f64 / s / (1u64 << 20) as f64
    );
    Ok(())
}

fn b(args: &Args) -> mralloc::Result<()> {
    // B may reach A and C through different devices: one PD each, one heap registered with both.
    let (dev_in, dev_out) = (args.get("device-in"), args.get("device-out"));
    let pd_in = pd_on(dev_in)?;
    let pd_out = if dev_out.is_some() && dev_out != dev_in { pd_on(dev_out)? } else { pd_in.clone() };
    let mut hb = Heap::builder().bind(&pd_in).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    if pd_out != pd_in {
        hb = hb.bind(&pd_out);
    }
    let heap = hb.build()?;
    let size = args.num("size", 16 << 20);
    let next = args.str_or("next", "127.0.0.1:7482");
    let to_c = common::retry(|| Connection::connect(next.as_str(), &pd_out, opts_on(dev_out)))?;
    // Exposed: A gets a key it may write through, until its immediate says the data is there.
    let landing = heap.alloc(size)?.expose()?;
    let bind = args.str_or("bind", "0.0.0.0");
    // A writes (with immediate) into `landing`: only this connection lets its peer write.
    let from_a_opts =
        Options { qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() }, ..opts_on(dev_in) };
    let listener = Listener::bind((bind.as_str(), args.num("port", 7481) as u16), &pd_in, from_a_opts)?;
    let from_a = listener.accept_with(&landing.remote_for(&pd_in)?.to_bytes())?;
    let t = Instant::now();
    let crc_a = from_a.recv_imm()?;
    // A is done: revoke its key and take the bytes back.
    let mut landing = landing.revoke()?;
    let got = crc32fast::hash(&landing);
    if got != crc_a {
        fail(&format!("B: data from A has CRC {got:08x}, A said {crc_a:08x}"));
    }
    let t_proc = Instant::now();
    transform(&mut landing);
    let crc_b = crc32fast::hash(&landing);
    let proc_ms = t_proc.elapsed().as_secs_f64() * 1e3;
    let t_fwd = Instant::now();
    to_c.send_with_imm(&landing, crc_b)?;
    println!(
        "B: received {size} bytes (CRC {crc_a:08x} ok) after {:.1} ms; transformed + checksummed in {proc_ms:.1} ms (CRC {crc_b:08x}); forwarded to C by SEND in {:.1} ms",
        (t_proc - t).as_secs_f64() * 1e3,
        t_fwd.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

fn c(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(args.get("device"), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let size = args.num("size", 16 << 20);
    let bind = args.str_or("bind", "0.0.0.0");
    let listener = Listener::bind((bind.as_str(), args.num("port", 7482) as u16), &pd, opts_on(args.get("device")))?;
    let from_b = listener.accept()?;
    let inbox = heap.alloc(size)?;
    let pending = from_b.post_recv(inbox)?;
    let t = Instant::now();
    let (inbox, got) = pending.wait()?;
    let recv_ms = t.elapsed().as_secs_f64() * 1e3;
    let t_verify = Instant::now();
    let mut want = common::data(42, size);
    transform(&mut want);
    let ok = got.len == size && inbox[..] == want[..] && got.imm == Some(crc32fast::hash(&want));
    println!(
        "C: received {} bytes by SEND (imm {:08x}) {recv_ms:.1} ms after posting; verified against its own computation in {:.1} ms: {}",
        got.len,
        got.imm.unwrap_or(0),
        t_verify.elapsed().as_secs_f64() * 1e3,
        if ok { "all bytes match" } else { "MISMATCH" }
    );
    if !ok {
        fail("C: relayed data differs");
    }
    Ok(())
}
