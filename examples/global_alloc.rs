//! `global_alloc`: the whole process allocates registered memory. Plain `Vec<u8>` and `String`
//! values — created before the device was even opened — are sent zero-copy after `Global::bind`.
//!
//! ```text
//! scripts/softroce -- cargo run --release --features global --example global_alloc -- [--size BYTES]
//! ```

mod common;

use std::time::Instant;

use common::{Args, Opt, Spec};
use mralloc::heap::Global;
use mralloc::transfer::{Connection, Options, QpOptions};
use mralloc::verbs::{Access, Pd, RegisteredBuf};

#[global_allocator]
static ALLOC: Global = Global::new();

static SPEC: Spec = Spec {
    name: "global_alloc",
    about: "The registered heap as #[global_allocator]: a plain Vec<u8> and String, made before the device\n\
            is opened, sent zero-copy by RDMA WRITE after Global::bind.",
    no_role: "",
    roles: &[],
    opts: &[Opt::num("size", "BYTES", "bytes of the Vec<u8>, the String about 2/3 of that (default 8388608 = 8 MiB)")],
};

fn main() {
    if let Err(e) = run() {
        eprintln!("global_alloc: {e}");
        std::process::exit(1);
    }
}

fn run() -> mralloc::Result<()> {
    let args = Args::parse(&SPEC);
    let size = args.num("size", 8 << 20);
    // Ordinary values, made with the ordinary std API, before any RDMA setup.
    let vec: Vec<u8> = common::data(1, size);
    let text: String = (0..size / 64).map(|i| format!("line {i:08} of a plain String, registered\n")).collect();
    println!("made a {}-byte Vec<u8> and a {}-byte String (before opening the device)", vec.len(), text.len());

    let ctx = Options::default().open_device()?;
    let pd = Pd::new(&ctx)?;
    let t = Instant::now();
    ALLOC.bind(&pd)?;
    let st = ALLOC.stats();
    println!(
        "Global::bind({}) in {:.1} ms: {} chunks, {} bytes registered, {} reg_mr calls",
        ctx.name(),
        t.elapsed().as_secs_f64() * 1e3,
        st.chunks,
        st.registered_bytes[0],
        st.reg_mr_calls
    );
    for (what, bytes) in [("Vec<u8>", &vec[..]), ("String", text.as_bytes())] {
        let keys =
            mralloc::keys_of(bytes.as_ptr()).ok_or(mralloc::Error::NotRegistered { addr: bytes.as_ptr() as u64 })?;
        println!("{what} at {:#x}: lkey {:#x}, chunk of {} bytes", bytes.as_ptr() as usize, keys.lkey, keys.chunk_len);
    }

    // A loopback connection; the peer offers a plain registered buffer.
    // (_b's QP must accept RDMA WRITEs: connections grant no remote rights unless asked.)
    let (a, _b) = Connection::pair(
        &pd,
        &Options { qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() }, ..Options::default() },
    )?;
    for (what, bytes) in [("Vec<u8>", &vec[..]), ("String", text.as_bytes())] {
        // Memory a peer writes is exposed: it lends no `&[u8]` until revoked.
        let dst = RegisteredBuf::new(&pd, bytes.len(), Access::LOCAL_WRITE)?.expose(Access::REMOTE_WRITE)?;
        let remote = dst.remote();
        let t = Instant::now();
        a.write(bytes, &remote, 0)?; // the std value itself is the source: no copy, no registration
        let secs = t.elapsed().as_secs_f64();
        let dst = dst.revoke()?;
        if &dst[..] != bytes {
            return Err(mralloc::Error::Protocol(format!("{what}: the peer's bytes differ")));
        }
        println!(
            "sent the {what} ({} bytes) zero-copy by RDMA WRITE: verified {} bytes at the peer, {:.1} MiB/s",
            bytes.len(),
            bytes.len(),
            bytes.len() as f64 / secs / (1u64 << 20) as f64
        );
    }
    println!("global_alloc: OK");
    Ok(())
}
