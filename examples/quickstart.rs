//! Quickstart: a registered heap, two connected RC queue pairs, RDMA WRITE, READ and SEND.
//!
//! ```text
//! scripts/softroce -- cargo run --release --example quickstart -- [--size BYTES]
//! ```
//!
//! Buffers come out of a `Heap` bound to the device: no `ibv_reg_mr` per buffer for local use,
//! lkeys included; only a buffer handed to the peer gets a registration (its rkey) of its own.
//! Both queue pairs live on one device (a loopback connection), so one process shows the whole
//! path: the endpoint each side prints is exactly what two hosts would exchange over TCP.

mod common;

use std::time::{Duration, Instant};

use common::{Args, Opt, Spec};
use mralloc::heap::Heap;
use mralloc::verbs::{Access, ConnectOptions, Context, Cq, Pd, Qp, SendOp, SendWr};

fn main() {
    if let Err(e) = run() {
        eprintln!("quickstart: {e}");
        std::process::exit(1);
    }
}

static SPEC: Spec = Spec {
    name: "quickstart",
    about: "A registered heap, two connected RC queue pairs on one device, RDMA WRITE, READ and SEND,\n\
            bytes verified.",
    no_role: "",
    roles: &[],
    opts: &[Opt::num("size", "BYTES", "bytes per buffer and transfer, at least 8 (default 4194304 = 4 MiB)")],
};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse(&SPEC);
    let size = args.num("size", 4 << 20);
    if size < 8 {
        args.usage_error("--size must be at least 8 bytes");
    }
    let wait = Duration::from_secs(30);

    let ctx = Context::open_default()?;
    let port = ctx.first_active_port().ok_or("no active port")?;
    let info = ctx.port(port)?;
    println!("device {} port {port}: {:?}, active MTU {} bytes", ctx.name(), info.state, info.active_mtu.bytes());

    let pd = Pd::new(&ctx)?;
    let heap =
        Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ).build()?;
    let t = Instant::now();
    let mut src = heap.alloc(size)?;
    let dst = heap.alloc(size)?;
    let back = heap.alloc(size)?;
    let inbox = heap.alloc(size)?;
    let (src_keys, dst_keys) = (src.keys().ok_or("src has no keys")?, dst.keys().ok_or("dst has no keys")?);
    println!(
        "heap: 4 x {size} bytes in {:.2} ms (registered per chunk, not per buffer): src lkey {:#x}; dst lkey {:#x}",
        t.elapsed().as_secs_f64() * 1e3,
        src_keys.lkey,
        dst_keys.lkey,
    );

    let cq = Cq::new(&ctx, 64)?;
    // a WRITEs into and READs from b's memory: b's QP must allow that (the default allows no
    // one-sided access at all); a's memory is only ever the target of SENDs.
    let a = Qp::builder(&pd, &cq, &cq).build()?;
    let b = Qp::builder(&pd, &cq, &cq).remote_access(Access::REMOTE_WRITE | Access::REMOTE_READ).build()?;
    println!("QP a endpoint: {:?}", a.endpoint());
    println!("QP b endpoint: {:?}", b.endpoint());
    a.connect(&b.endpoint(), &ConnectOptions::default())?;
    b.connect(&a.endpoint(), &ConnectOptions::default())?;
    println!("connected QP {} <-> QP {} (RC)", a.qpn(), b.qpn());

    for (i, byte) in src.iter_mut().enumerate() {
        *byte = (i as u64).wrapping_mul(2654435761).to_le_bytes()[1];
    }
    // a WRITEs into dst, so dst goes to the network (`expose`) with a key of its own: a
    // registration of exactly dst, removed when dst is dropped. Its bytes are read by copying out.
    let dst = dst.expose()?;
    let remote = dst.remote();
    println!("peer would be sent: {remote:?}");

    // RDMA WRITE: a's src -> b's dst.
    let sge = [src.sge(..)?];
    let t = Instant::now();
    // SAFETY: src and dst stay alive and are not touched by the CPU until the completion below.
    unsafe { a.post_send(&[SendWr::new(1, &sge, SendOp::Write(remote.at(0, size as u64)?))])? };
    cq.next(wait)?.ok()?;
    let took = t.elapsed(); // before the copy out of dst
    report("RDMA WRITE", &src, &dst.to_vec(), took)?;

    // RDMA READ: b's dst -> a's back buffer.
    let sge = [back.sge(..)?];
    let t = Instant::now();
    // SAFETY: as above, for back and dst.
    unsafe { a.post_send(&[SendWr::new(2, &sge, SendOp::Read(remote.at(0, size as u64)?))])? };
    cq.next(wait)?.ok()?;
    report("RDMA READ ", &src, &back, t.elapsed())?;

    // SEND/RECV: b posts a receive into inbox, a sends src.
    let rsge = [inbox.sge(..)?];
    // SAFETY: inbox stays alive and untouched until the receive completes below.
    unsafe { b.post_recv(7, &rsge)? };
    let sge = [src.sge(..)?];
    let t = Instant::now();
    // SAFETY: src stays alive until the completions below.
    unsafe { a.post_send(&[SendWr::new(3, &sge, SendOp::SendWithImm(0x600d))])? };
    let mut imm = None;
    for _ in 0..2 {
        let wc = cq.next(wait)?;
        wc.ok()?;
        if wc.wr_id() == 7 {
            imm = wc.imm();
        }
    }
    report("SEND/RECV ", &src, &inbox, t.elapsed())?;
    println!("receive carried immediate {}", imm.map_or("none".to_string(), |v| format!("{v:#x}")));
    let st = heap.stats();
    println!(
        "heap stats: {} chunks, {} bytes registered, {} reg_mr calls in {:?}, {} live bytes",
        st.chunks, st.registered_bytes[0], st.reg_mr_calls, st.reg_mr_time, st.live_bytes
    );
    println!("quickstart: OK");
    Ok(())
}

fn report(what: &str, want: &[u8], got: &[u8], took: Duration) -> Result<(), String> {
    if let Some(i) = want.iter().zip(got).position(|(x, y)| x != y) {
        return Err(format!("{what}: byte {i} differs"));
    }
    let n = want.len();
    println!(
        "{what} {n} bytes: verified {n}/{n} bytes in {:.3} ms ({:.1} MiB/s)",
        took.as_secs_f64() * 1e3,
        n as f64 / took.as_secs_f64() / (1 << 20) as f64
    );
    Ok(())
}
