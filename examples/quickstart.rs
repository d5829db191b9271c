//! Quickstart: register memory, connect two RC queue pairs, RDMA WRITE and READ, verify.
//!
//! ```text
//! scripts/softroce -- cargo run --release --example quickstart -- [--size BYTES]
//! ```
//!
//! Both queue pairs live on one device (a loopback connection), so one process shows the whole
//! path: the endpoint each side prints is exactly what two hosts would exchange over TCP.

use std::time::{Duration, Instant};

use mralloc::verbs::{Access, ConnectOptions, Context, Cq, Pd, Qp, RegisteredBuf, SendOp, SendWr};

fn main() {
    if let Err(e) = run() {
        eprintln!("quickstart: {e}");
        std::process::exit(1);
    }
}

fn parse_size() -> Result<usize, String> {
    let mut args = std::env::args().skip(1);
    let mut size = 4 << 20;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--size" => {
                let v = args.next().ok_or("--size needs a value")?;
                size = v.parse().map_err(|_| format!("--size {v}: not a byte count"))?;
            }
            "-h" | "--help" => {
                println!("usage: quickstart [--size BYTES]   (default 4 MiB)");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if size < 8 {
        return Err("--size must be at least 8 bytes".into());
    }
    Ok(size)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let size = parse_size()?;
    let wait = Duration::from_secs(30);

    let ctx = Context::open_default()?;
    let port = ctx.first_active_port().ok_or("no active port")?;
    let info = ctx.port(port)?;
    println!("device {} port {port}: {:?}, active MTU {} bytes", ctx.name(), info.state, info.active_mtu.bytes());

    let pd = Pd::new(&ctx)?;
    let cq = Cq::new(&ctx, 64)?;
    let started = Instant::now();
    let mut src = RegisteredBuf::new(&pd, size, Access::LOCAL_WRITE)?;
    let dst = RegisteredBuf::new(&pd, size, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    let back = RegisteredBuf::new(&pd, size, Access::LOCAL_WRITE)?;
    println!(
        "registered 3 x {size} bytes in {:.2} ms: src lkey {:#x}; dst lkey {:#x} rkey {:#x}",
        started.elapsed().as_secs_f64() * 1e3,
        src.mr().lkey(),
        dst.mr().lkey(),
        dst.mr().rkey()
    );

    let a = Qp::builder(&pd, &cq, &cq).build()?;
    let b = Qp::builder(&pd, &cq, &cq).build()?;
    println!("QP a endpoint: {:?}", a.endpoint());
    println!("QP b endpoint: {:?}", b.endpoint());
    a.connect(&b.endpoint(), &ConnectOptions::default())?;
    b.connect(&a.endpoint(), &ConnectOptions::default())?;
    println!("connected QP {} <-> QP {} (RC)", a.qpn(), b.qpn());

    for (i, byte) in src.iter_mut().enumerate() {
        *byte = (i as u64).wrapping_mul(2654435761).to_le_bytes()[1];
    }

    // RDMA WRITE: a's src -> b's dst.
    let sge = [src.sge(0..size)?];
    let t = Instant::now();
    // SAFETY: src and dst stay alive and are not touched by the CPU until the completion below.
    unsafe { a.post_send(&[SendWr::new(1, &sge, SendOp::Write(dst.mr().remote(0)?))])? };
    cq.next(wait)?.ok()?;
    let write_s = t.elapsed().as_secs_f64();
    let mismatch = src.iter().zip(dst.iter()).position(|(x, y)| x != y);
    if let Some(i) = mismatch {
        return Err(format!("RDMA WRITE: byte {i} differs").into());
    }
    println!(
        "RDMA WRITE {size} bytes: verified {size}/{size} bytes in {:.3} ms ({:.1} MiB/s)",
        write_s * 1e3,
        size as f64 / write_s / (1 << 20) as f64
    );

    // RDMA READ: b's dst -> a's back buffer.
    let sge = [back.sge(0..size)?];
    let t = Instant::now();
    // SAFETY: as above, for back and dst.
    unsafe { a.post_send(&[SendWr::new(2, &sge, SendOp::Read(dst.mr().remote(0)?))])? };
    let wc = cq.next(wait)?;
    wc.ok()?;
    let read_s = t.elapsed().as_secs_f64();
    if let Some(i) = src.iter().zip(back.iter()).position(|(x, y)| x != y) {
        return Err(format!("RDMA READ: byte {i} differs").into());
    }
    println!(
        "RDMA READ  {size} bytes: verified {size}/{size} bytes in {:.3} ms ({:.1} MiB/s), completion {:?}",
        read_s * 1e3,
        size as f64 / read_s / (1 << 20) as f64,
        wc.opcode()
    );
    println!("first bytes: {:02x?}", &back[..8.min(size)]);
    println!("quickstart: OK");
    Ok(())
}
