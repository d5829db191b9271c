//! `file_transfer`: a client sends a file — mapped read-only and registered — by RDMA WRITE straight
//! into the server's `MappedFile::create`; the bytes never pass through a buffer. CRC-32 is
//! checked on both sides.
//!
//! ```text
//! # both roles in one command (the server runs as a child process):
//! scripts/softroce -- cargo run --release --example file_transfer -- [--size BYTES | --file PATH]
//! # or on two hosts:
//! file_transfer server --port 7472 --out /data/copy.bin
//! file_transfer client --addr SERVER:7472 --file /data/big.bin
//! ```

mod common;

use std::path::PathBuf;
use std::time::Instant;

use common::{fail, Args, Opt, Spec, NO_ROLE};
use mralloc::transfer::{Connection, Listener, MappedFile, Mode, Options, QpOptions};
use mralloc::verbs::Access;
use mralloc::RemoteBuf;

const CHUNK: usize = 4 << 20;

static SPEC: Spec = Spec {
    name: "file_transfer",
    about: "A client sends a file, mapped read-only and registered, by RDMA WRITE straight into the server's\n\
            MappedFile::create; CRC-32 checked on both sides.",
    no_role: "both roles in this command (the server runs as a child process)",
    roles: &[("server", "receive one file into --out"), ("client", "send --file (or generated data) to --addr")],
    opts: &[
        Opt::num("size", "BYTES", "bytes of generated data to send without --file (default 67108864 = 64 MiB)")
            .roles(&[NO_ROLE, "client"]),
        Opt::text("file", "PATH", "the file to send (default: --size bytes generated in a scratch file)")
            .roles(&[NO_ROLE, "client"]),
        Opt::port("port", "the port to listen on (default 7472)").roles(&["server"]),
        Opt::text("out", "PATH", "the received copy (default mralloc-received.bin in /dev/shm, or else the temp dir)")
            .roles(&["server"]),
        Opt::text("addr", "HOST:PORT", "the server (default 127.0.0.1:7472)").roles(&["client"]),
    ],
};

fn scratch_dir() -> PathBuf {
    // A local filesystem: /dev/shm where there is one.
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

fn main() {
    let args = Args::parse(&SPEC);
    let r = match args.role.as_deref() {
        Some("server") => server(&args),
        Some("client") => client(&args),
        None => both(&args),
        Some(other) => fail(&format!("unknown role {other} (server | client)")),
    };
    if let Err(e) = r {
        fail(&format!("file_transfer: {e}"));
    }
}

fn both(args: &Args) -> mralloc::Result<()> {
    let port = common::free_port();
    let out = scratch_dir().join(format!("mralloc-received-{}.bin", std::process::id()));
    let server =
        common::spawn_role("server", &["--port".into(), port.to_string(), "--out".into(), out.display().to_string()]);
    let mut cargs = vec!["--addr".to_string(), format!("127.0.0.1:{port}")];
    if let Some(f) = args.get("file") {
        cargs.extend(["--file".into(), f.into()]);
    } else {
        cargs.extend(["--size".into(), args.num("size", 64 << 20).to_string()]);
    }
    let client = common::spawn_role("client", &cargs);
    common::wait_all(vec![("client".into(), client), ("server".into(), server)]);
    let _ = std::fs::remove_file(&out);
    println!("file_transfer: OK");
    Ok(())
}

fn server(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(None, Access::LOCAL_WRITE)?;
    let port = args.num("port", 7472) as u16;
    let out = PathBuf::from(args.str_or("out", &scratch_dir().join("mralloc-received.bin").display().to_string()));
    // The client RDMA-WRITEs into the file mapped here: this side's QP must allow it.
    let opts =
        Options { qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() }, ..Options::default() };
    let listener = Listener::bind(("0.0.0.0", port), &pd, opts)?;
    println!("listening on port {port}, receiving into {}", out.display());
    let conn = listener.accept()?;
    let mut header = heap.alloc(12)?;
    conn.recv(&mut header)?;
    let size = u64::from_be_bytes(header[..8].try_into().expect("8 bytes"));
    let crc_sent = u32::from_be_bytes(header[8..12].try_into().expect("4 bytes"));
    // SAFETY: the server's own output file; nothing else opens it while it is mapped.
    // Exposed: the client may RDMA WRITE it, so it lends no `&[u8]` until revoked.
    let dst = unsafe { MappedFile::create(&out, size, &pd)? }.expose()?;
    let mut offer = heap.alloc(RemoteBuf::ENCODED_LEN)?;
    offer.copy_from_slice(&dst.remote().to_bytes());
    conn.send(&offer)?;
    println!("offered {size} bytes of {} (rkey {:#x})", out.display(), dst.remote().rkey);
    let mut done = heap.alloc(1)?;
    conn.recv(&mut done)?; // the client has written everything
    let dst = dst.revoke()?; // the key is dead: the bytes are ours to read
    dst.flush()?;
    let crc = crc32fast::hash(dst.as_slice());
    let mut verdict = heap.alloc(1)?;
    verdict[0] = u8::from(crc == crc_sent);
    conn.send(&verdict)?;
    println!(
        "received {size} bytes into {}: CRC-32 {crc:08x} (client's {crc_sent:08x}) {}",
        out.display(),
        if crc == crc_sent { "match" } else { "MISMATCH" }
    );
    if crc != crc_sent {
        fail("CRC mismatch");
    }
    Ok(())
}

fn client(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(None, Access::LOCAL_WRITE)?;
    let path = match args.get("file") {
        Some(f) => PathBuf::from(f),
        None => {
            let size = args.num("size", 64 << 20);
            let p = scratch_dir().join(format!("mralloc-send-{}.bin", std::process::id()));
            let mut bytes = Vec::with_capacity(size);
            while bytes.len() < size {
                bytes.extend_from_slice(&common::data(bytes.len() as u64, (size - bytes.len()).min(1 << 20)));
            }
            std::fs::write(&p, &bytes)
                .map_err(|source| mralloc::Error::Io { what: format!("writing {}", p.display()), source })?;
            println!("generated {size} bytes in {}", p.display());
            p
        }
    };
    // SAFETY: the file to send must not change while it is mapped (the example's own input).
    let src = unsafe { MappedFile::open(&path, Mode::ReadOnly, &pd)? };
    let crc = crc32fast::hash(src.as_slice());
    let addr = args.str_or("addr", "127.0.0.1:7472");
    let conn = common::retry(|| Connection::connect(addr.as_str(), &pd, Options::default()))?;
    let mut header = heap.alloc(12)?;
    header[..8].copy_from_slice(&(src.len() as u64).to_be_bytes());
    header[8..].copy_from_slice(&crc.to_be_bytes());
    conn.send(&header)?;
    let mut offer = heap.alloc(RemoteBuf::ENCODED_LEN)?;
    conn.recv(&mut offer)?;
    let remote = RemoteBuf::from_bytes(&offer)?;
    println!("sending {} ({} bytes, CRC-32 {crc:08x}) to {addr}", path.display(), src.len());
    let progress = common::progress_bar(src.len() as u64);
    let t = Instant::now();
    let mut off = 0;
    while off < src.len() {
        // Up to 8 chunks per batch: one doorbell each few, several in flight.
        let slices: Vec<_> = (0..8)
            .map(|i| off + i * CHUNK)
            .take_while(|&o| o < src.len())
            .map(|o| src.slice(o..(o + CHUNK).min(src.len())).map(|s| (o, s)))
            .collect::<mralloc::Result<_>>()?;
        let mut batch = conn.batch();
        for (o, s) in &slices {
            batch.write(s, &remote, *o as u64)?;
        }
        batch.submit()?;
        off = slices.last().map_or(src.len(), |(o, s)| o + s.as_slice().len());
        progress.set_position(off as u64);
    }
    progress.finish();
    let secs = t.elapsed().as_secs_f64();
    let mut done = heap.alloc(1)?;
    done[0] = 1;
    conn.send(&done)?;
    let mut verdict = heap.alloc(1)?;
    conn.recv(&mut verdict)?;
    println!(
        "wrote {} bytes in {:.2} s ({:.1} MiB/s); server CRC {}",
        src.len(),
        secs,
        src.len() as f64 / secs / (1u64 << 20) as f64,
        if verdict[0] == 1 { "matches" } else { "DIFFERS" }
    );
    if args.get("file").is_none() {
        let _ = std::fs::remove_file(&path);
    }
    if verdict[0] != 1 {
        fail("the server's CRC differs");
    }
    Ok(())
}
