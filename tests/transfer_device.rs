//! The transfer layer against a real device (Soft-RoCE in the VM). Run by `scripts/test`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, MappedFile, Mode, Options, WaitMode, WaitOptions};
use mralloc::verbs::{Access, Pd, WcStatus};
use mralloc::{Disconnect, Error, RemoteBuf};

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    (pd, heap)
}

const SIZES: [usize; 6] = [1, 63, 4096, 65536, 1 << 20, 16 << 20];

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_every_operation_at_every_size_and_unaligned_offsets() {
    let (pd, heap) = setup();
    let (a, b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE | Access::REMOTE_READ)).unwrap();
    for (i, &n) in SIZES.iter().enumerate() {
        let off = 3 + i * 7; // unaligned local and remote offsets
        let want = pattern(i as u64, n);
        let mut src = heap.alloc(n + off).unwrap();
        src[off..].copy_from_slice(&want);
        let dst = heap.alloc(n + 2 * off).unwrap().expose().unwrap();
        let remote = dst.remote();

        // WRITE from an unaligned slice of heap memory to an unaligned remote offset.
        a.write(&src[off..], &remote, off as u64).unwrap();
        assert_bytes_eq(&dst.to_vec()[off..off + n], &want, &format!("write {n}"));

        // READ it back into another unaligned slice.
        let mut back = heap.alloc(n + off).unwrap();
        a.read(&mut back[off..], &remote, off as u64).unwrap();
        assert_bytes_eq(&back[off..], &want, &format!("read {n}"));

        // SEND/RECV: b receives into a posted (owned) buffer.
        let inbox = heap.alloc(n).unwrap();
        let pending = b.post_recv(inbox).unwrap();
        a.send(&src[off..]).unwrap();
        let (inbox, got) = pending.wait().unwrap();
        assert_eq!(got.len, n);
        assert_bytes_eq(&inbox, &want, &format!("send/recv {n}"));

        // WRITE with immediate: data lands, the immediate arrives at b.
        let dst2 = heap.alloc(n).unwrap().expose().unwrap();
        let waiter = std::thread::scope(|s| {
            let h = s.spawn(|| b.recv_imm());
            a.write_with_imm(&src[off..], &dst2.remote(), 0, 0xC0DE_0000 + i as u32).unwrap();
            h.join().unwrap()
        });
        assert_eq!(waiter.unwrap(), 0xC0DE_0000 + i as u32);
        let dst2 = dst2.revoke().unwrap();
        assert_bytes_eq(&dst2, &want, &format!("write_with_imm {n}"));
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_sends_and_immediates_arrive_in_order() {
    let (pd, heap) = setup();
    let (a, b) = Connection::pair(&pd, &Options::default()).unwrap();
    let pendings: Vec<_> = (0..16).map(|_| b.post_recv(heap.alloc(256).unwrap()).unwrap()).collect();
    for i in 0..16u32 {
        let mut m = heap.alloc(256).unwrap();
        m.fill(i as u8);
        a.send_with_imm(&m, 1000 + i).unwrap();
    }
    for (i, p) in pendings.into_iter().enumerate() {
        let (buf, got) = p.wait().unwrap();
        assert_eq!(got.imm, Some(1000 + i as u32), "immediates in order");
        assert!(buf.iter().all(|&x| x == i as u8), "message {i} in order");
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_atomics_from_two_threads_sum_exactly() {
    let (pd, heap) = setup();
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_ATOMIC)).unwrap();
    let mut word = heap.alloc_layout(std::alloc::Layout::from_size_align(8, 8).unwrap()).unwrap();
    word.fill(0);
    let word = word.expose().unwrap();
    let remote = word.remote();
    const N: u64 = 200;
    let olds: Vec<u64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| s.spawn(|| (0..N).map(|_| a.fetch_add(&remote, 0, 1).unwrap()).collect::<Vec<_>>()))
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(u64::from_ne_bytes(word.to_vec()[..8].try_into().unwrap()), 2 * N);
    let mut sorted = olds.clone();
    sorted.sort();
    assert_eq!(sorted, (0..2 * N).collect::<Vec<_>>(), "every old value seen exactly once");
    assert_eq!(a.compare_swap(&remote, 0, 2 * N, 7).unwrap(), 2 * N);
    assert_eq!(a.compare_swap(&remote, 0, 2 * N, 9).unwrap(), 7, "no swap when the compare fails");
    assert!(matches!(a.fetch_add(&remote, 1, 1), Err(Error::InvalidArgument(_)) | Err(Error::OutOfBounds { .. })));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_batch_of_1000_writes_with_selective_signaling() {
    let (pd, heap) = setup();
    let mut opts = rights(Access::REMOTE_WRITE);
    opts.qp.send_depth = 64;
    let (a, _b) = Connection::pair(&pd, &opts).unwrap();
    let srcs: Vec<_> = (0..10)
        .map(|i| {
            let mut s = heap.alloc(4096).unwrap();
            s.copy_from_slice(&pattern(50 + i, 4096));
            s
        })
        .collect();
    let dst = heap.alloc(1000 * 4096).unwrap().expose().unwrap();
    let remote = dst.remote();
    let t = Instant::now();
    let before = a.stats();
    let mut batch = a.batch();
    for i in 0..1000 {
        batch.write(&srcs[i % 10], &remote, (i * 4096) as u64).unwrap();
    }
    assert_eq!(batch.len(), 1000);
    batch.submit().unwrap();
    println!("batch of 1000 x 4 KiB writes (send depth 64): {:?}", t.elapsed());
    // Selective signalling: one completion per chunk of a quarter of the send queue (16
    // requests), not one per request.
    let after = a.stats();
    assert_eq!(after.send_requests - before.send_requests, 1000);
    assert_eq!(
        after.completions - before.completions,
        1000_u64.div_ceil(16),
        "a batch of 1000 WRITEs on a send queue of 64 signals one request per chunk of 16"
    );
    let dst = dst.revoke().unwrap();
    for i in 0..1000 {
        assert_bytes_eq(&dst[i * 4096..(i + 1) * 4096], &srcs[i % 10], &format!("batch write {i}"));
    }
    assert!(a.error().is_none());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_mapped_file_64mib_zero_copy() {
    let pd = Pd::new(&open()).unwrap();
    // A local filesystem: in the VM /tmp is the host's over 9p (cache=none), whose pages cannot be
    // pinned for registration; /dev/shm is the VM's own tmpfs.
    let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    let dir = base.join(format!("mralloc-mapped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src_path, dst_path) = (dir.join("src.bin"), dir.join("dst.bin"));
    const N: usize = 64 << 20;
    let data = pattern(77, N);
    std::fs::write(&src_path, &data).unwrap();
    let want = checksum(&data);
    drop(data);
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    // SAFETY: the test's own files; nothing else touches them while they are mapped.
    let src = unsafe { MappedFile::open(&src_path, Mode::ReadOnly, &pd) }.unwrap();
    // SAFETY: as above.
    let dst = unsafe { MappedFile::create(&dst_path, N as u64, &pd) }.unwrap();
    // A plain key is read-only: the peer may write the file only while it is exposed.
    let dst = dst.expose().unwrap();
    let t = Instant::now();
    // One WRITE per 4 MiB slice of the read-only mapping into the created file's mapping.
    let remote = dst.remote();
    let slices: Vec<_> = (0..N).step_by(4 << 20).map(|o| src.slice(o..o + (4 << 20)).unwrap()).collect();
    let mut batch = a.batch();
    for (i, s) in slices.iter().enumerate() {
        batch.write(s, &remote, (i * (4 << 20)) as u64).unwrap();
    }
    batch.submit().unwrap();
    let dst = dst.revoke().unwrap();
    dst.flush().unwrap();
    let took = t.elapsed();
    drop(dst);
    let got = checksum(&std::fs::read(&dst_path).unwrap());
    println!("64 MiB mapped file -> mapped file by RDMA WRITE in {took:?}; checksum {want:#018x} / {got:#018x}");
    assert_eq!(got, want);
    // A read-only mapping as the target of a READ: the CPU gets no mutable slice of it, and the
    // NIC refuses to write into it (its region has no LOCAL_WRITE): a typed completion error,
    // and not one byte of the file changes.
    // SAFETY: as above (`src` is only ever read).
    let mut ro = unsafe { MappedFile::open(&src_path, Mode::ReadOnly, &pd) }.unwrap();
    assert!(ro.as_mut_slice().is_err());
    let (r, _s) = Connection::pair(&pd, &rights(Access::REMOTE_READ)).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::REMOTE_READ).build().unwrap();
    let mut from = heap.alloc(N).unwrap();
    from.fill(0xEE);
    let err = r.read(&mut ro, &from.remote().unwrap(), 0).unwrap_err();
    println!("READ into a read-only mapping: {err}");
    assert_eq!(err.wc_status(), Some(WcStatus::LocProtErr), "the NIC refused to write the read-only mapping: {err}");
    drop(ro);
    assert_eq!(checksum(&std::fs::read(&src_path).unwrap()), want, "the read-only file is unchanged");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Asserts that `again` (a later post's error on a failed connection) is the failure `first`
/// recorded, not the outcome of a new post: the same work request and status for a failed
/// operation; RESP_TIMEOUT_ERR for an expired operation timeout; the same reason for a
/// connection found dead.
fn assert_same_failure(first: &Error, again: &Error) {
    match (first, again) {
        (Error::Operation { wr_id: a, status: s, .. }, Error::Operation { wr_id: b, status: t, .. }) => {
            assert_eq!((a, s), (b, t), "the original failure, not a new post: {again}")
        }
        (Error::Timeout(..), Error::Operation { status, .. }) => {
            assert_eq!(*status, WcStatus::RespTimeoutErr, "the recorded timeout, not a new post: {again}")
        }
        (Error::Disconnected(a), Error::Disconnected(b)) => assert_eq!(a, b, "the recorded reason: {again}"),
        _ => panic!("{again:?} is not the recorded failure {first:?}"),
    }
}

fn checksum(b: &[u8]) -> u64 {
    // FNV-1a over 8-byte words (fast enough under TCG).
    b.chunks(8).fold(0xcbf2_9ce4_8422_2325u64, |h, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        (h ^ u64::from_le_bytes(w)).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_errors_are_typed_and_the_connection_fails_fast() {
    let (pd, heap) = setup();
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    let src = heap.alloc(4096).unwrap();
    let dst = heap.alloc(4096).unwrap().expose().unwrap();
    let remote = dst.remote();
    // Out of range: refused locally, the connection stays usable.
    assert!(matches!(a.write(&src, &remote, 1), Err(Error::OutOfBounds { .. })));
    assert!(matches!(a.write(&src, &remote, u64::MAX), Err(Error::OutOfBounds { .. })));
    // Foreign (unregistered) memory: refused locally.
    #[allow(clippy::useless_vec)] // deliberately process-heap (glibc) memory: never registered
    let foreign = vec![0u8; 100];
    assert!(matches!(a.write(&foreign[..], &remote, 0), Err(Error::NotRegistered { .. })));
    // Zero-length: refused.
    assert!(matches!(a.write(&src[..0], &remote, 0), Err(Error::InvalidArgument(_))));
    a.write(&src, &remote, 0).unwrap();
    // Wrong rkey: the NIC says REM_ACCESS_ERR; the connection is failed.
    let bad = RemoteBuf { rkey: remote.rkey ^ 0x77_0000, ..remote };
    let err = a.write(&src, &bad, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");
    // Later posts fail with the original error itself (same work request id, same status),
    // without a timeout. (A post on the failed QP would also report the recorded failure once
    // flushed; the owned post below shows the refusal happens before posting: the buffer comes
    // back.)
    let again = a.write(&src, &remote, 0).unwrap_err();
    assert_eq!(again.wc_status(), Some(WcStatus::RemAccessErr), "later posts report the original error: {again}");
    assert_same_failure(&err, &again);
    assert!(matches!(a.post_write(src, &remote, 0), Err(r) if r.buf.is_some()), "a refused post gives the buffer back");
    // A heap without remote rights never hands out an rkey.
    let local_only = Heap::builder().bind(&pd).build().unwrap();
    assert!(matches!(local_only.alloc(64).unwrap().remote(), Err(Error::NoRemoteAccess)));
}

/// Two processes: a server (child) offering a buffer through the TCP blob, a client writing
/// into it with an immediate; then the client is killed mid-stream by the server's view.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_two_processes_over_tcp_exchange() {
    if let Ok(port) = std::env::var("MRALLOC_TCP_SERVER") {
        return server(port.parse().unwrap());
    }
    let port = 20000 + (std::process::id() % 20000) as u16;
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "device_two_processes_over_tcp_exchange", "--ignored", "--nocapture", "--test-threads=1"])
        .env("MRALLOC_TCP_SERVER", port.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (pd, heap) = setup();
    let addr = format!("127.0.0.1:{port}");
    let start = Instant::now();
    let conn = loop {
        match Connection::connect(&addr, &pd, Options::default()) {
            Ok(c) => break c,
            Err(_) if start.elapsed() < Duration::from_secs(60) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => panic!("connecting to the server process: {e}"),
        }
    };
    let remote = RemoteBuf::from_bytes(conn.peer_blob()).unwrap();
    let mut data = heap.alloc(1 << 20).unwrap();
    data.copy_from_slice(&pattern(99, 1 << 20));
    conn.write_with_imm(&data, &remote, 0, 42).unwrap();
    let mut ack = heap.alloc(8).unwrap();
    let got = conn.recv(&mut ack).unwrap();
    assert_eq!((got.len, &ack[..]), (8, &b"verified"[..]));
    let text = finish_child(child, "server");
    assert!(text.contains("server: verified 1048576 bytes, imm 42"));
}

fn server(port: u16) {
    let (pd, heap) = setup();
    let inbox = heap.alloc(1 << 20).unwrap().expose().unwrap();
    // The server's memory is the target of the client's WRITE: it asks for that right.
    let listener = Listener::bind(("127.0.0.1", port), &pd, rights(Access::REMOTE_WRITE)).unwrap();
    let conn = listener.accept_with(&inbox.remote().to_bytes()).unwrap();
    let imm = conn.recv_imm().unwrap();
    let inbox = inbox.revoke().unwrap();
    assert_bytes_eq(&inbox, &pattern(99, 1 << 20), "server inbox");
    let mut ack = heap.alloc(8).unwrap();
    ack.copy_from_slice(b"verified");
    conn.send(&ack).unwrap();
    println!("server: verified {} bytes, imm {imm}", inbox.len());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_peer_killed_mid_stream_surfaces_as_a_typed_error() {
    if let Ok(port) = std::env::var("MRALLOC_VICTIM") {
        // The victim: offer a buffer, then wait to be killed.
        let (pd, heap) = setup();
        let inbox = heap.alloc(1 << 20).unwrap().expose().unwrap();
        let l = Listener::bind(("127.0.0.1", port.parse::<u16>().unwrap()), &pd, rights(Access::REMOTE_WRITE)).unwrap();
        let _conn = l.accept_with(&inbox.remote().to_bytes()).unwrap();
        println!("victim: connected");
        std::thread::sleep(Duration::from_secs(600));
        return;
    }
    let port = 40000 + (std::process::id() % 20000) as u16;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "device_peer_killed_mid_stream_surfaces_as_a_typed_error", "--ignored", "--nocapture"])
        .env("MRALLOC_VICTIM", port.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (pd, heap) = setup();
    let opts = Options {
        wait: WaitOptions { op_timeout: Duration::from_secs(10), ..Default::default() },
        ..Options::default()
    };
    let conn = connect_retrying(|| Connection::connect(("127.0.0.1", port), &pd, opts.clone()));
    let remote = RemoteBuf::from_bytes(conn.peer_blob()).unwrap();
    let mut data = heap.alloc(64 << 10).unwrap();
    data.copy_from_slice(&pattern(31, 64 << 10));
    for _ in 0..10 {
        conn.write(&data, &remote, 0).unwrap();
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let t = Instant::now();
    let mut err = None;
    for _ in 0..1000 {
        if let Err(e) = conn.write(&data, &remote, 0) {
            err = Some(e);
            break;
        }
    }
    let took = t.elapsed();
    let err = err.expect("writes to a dead peer must fail");
    println!("peer killed: next operation failed after {took:?} with: {err}");
    assert!(took < Duration::from_secs(25), "surfaced within the configured timeout (loosely)");
    // The connection watcher sees the peer's setup stream close (the kernel closed the dead
    // process's socket) before the NIC gives up on the dead QP (RETRY_EXC_ERR after ~0.5 s of
    // retries) or the operation timeout (10 s) would: the watcher's typed reason, nothing else.
    assert!(
        matches!(err, Error::Disconnected(Disconnect::PeerClosed | Disconnect::PeerReset { .. })),
        "the watcher's reason for a killed peer: {err:?}"
    );
    // A failed connection refuses posts with the failure that came first (same work request).
    let again = conn.write(&data, &remote, 0).unwrap_err();
    assert_same_failure(&err, &again);
    // The survivor's other connections keep working.
    let (x, _y) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    let dst = heap.alloc(64 << 10).unwrap().expose().unwrap();
    x.write(&data, &dst.remote(), 0).unwrap();
    assert_bytes_eq(&dst.revoke().unwrap(), &data, "the other connection's write arrived");
}

/// Two processes connected through the RDMA connection manager (server = child process).
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_two_processes_over_rdma_cm() {
    let ip = std::env::var("MRALLOC_CM_ADDR")
        .expect("MRALLOC_CM_ADDR: an IP address of the RDMA device (scripts/softroce sets it)");
    if let Ok(port) = std::env::var("MRALLOC_CM_SERVER") {
        let (pd, heap) = setup();
        let inbox = heap.alloc(256 << 10).unwrap().expose().unwrap();
        let l = mralloc::transfer::CmListener::bind(
            (ip.as_str(), port.parse::<u16>().unwrap()),
            &pd,
            rights(Access::REMOTE_WRITE),
        )
        .unwrap();
        println!("cm server: listening");
        let conn = l.accept_with(&inbox.remote().to_bytes()).unwrap();
        assert_eq!(conn.peer_blob(), b"hello over cm");
        let imm = conn.recv_imm().unwrap();
        let inbox = inbox.revoke().unwrap();
        assert_bytes_eq(&inbox, &pattern(5, 256 << 10), "cm server inbox");
        let mut ack = heap.alloc(2).unwrap();
        ack.copy_from_slice(b"ok");
        conn.send(&ack).unwrap();
        println!("cm server: verified {} bytes, imm {imm}", inbox.len());
        return;
    }
    let port = 30000 + (std::process::id() % 20000) as u16;
    let child = spawn_self("device_two_processes_over_rdma_cm", ("MRALLOC_CM_SERVER", port.to_string()));
    let (pd, heap) = setup();
    let conn = connect_retrying(|| {
        Connection::connect_cm_with((ip.as_str(), port), &pd, Options::default(), b"hello over cm")
    });
    // The peer's GID, from the CM's route (what a RemoteDesc names the peer's device by).
    let want = mralloc::verbs::Gid::from_bytes(ip.parse::<std::net::Ipv4Addr>().unwrap().to_ipv6_mapped().octets());
    assert_eq!(conn.peer().gid, want, "the CM peer's GID");
    let remote = RemoteBuf::from_bytes(conn.peer_blob()).unwrap();
    let mut data = heap.alloc(256 << 10).unwrap();
    data.copy_from_slice(&pattern(5, 256 << 10));
    conn.write_with_imm(&data, &remote, 0, 7).unwrap();
    let mut ack = heap.alloc(2).unwrap();
    assert_eq!(conn.recv(&mut ack).unwrap().len, 2);
    assert_eq!(&ack[..], b"ok");
    let text = finish_child(child, "server");
    assert!(text.contains("cm server: verified 262144 bytes, imm 7"));
    // Blobs over the CM limit are refused before anything is sent.
    let big = [0u8; mralloc::transfer::MAX_CM_BLOB + 1];
    assert!(matches!(
        Connection::connect_cm_with((ip.as_str(), port), &pd, Options::default(), &big),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_grant_gives_scoped_revocable_access() {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE | Access::MW_BIND).build().unwrap();
    let (a, b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE | Access::REMOTE_READ)).unwrap();
    let mut target = heap.alloc(8192).unwrap();
    target.fill(0);
    let g = b.grant(target, Access::REMOTE_WRITE | Access::REMOTE_READ).unwrap();
    let remote = g.remote();
    assert_ne!(remote.rkey, heap.keys(remote.addr as *const u8).unwrap().rkey, "a key of its own, not the heap's");
    let mut src = heap.alloc(8192).unwrap();
    src.copy_from_slice(&pattern(8, 8192));
    a.write(&src, &remote, 0).unwrap();
    let mut back = heap.alloc(8192).unwrap();
    a.read(&mut back, &remote, 0).unwrap();
    assert_bytes_eq(&back, &src, "through the grant");
    let target = g.revoke().unwrap();
    assert_bytes_eq(&target, &src, "granted buffer after revoke");
    let err = a.write(&src, &remote, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "revoked grant: {err}");

    // The grant's RemoteBuf covers exactly the buffer; a larger write is refused locally before
    // posting. (A hand-made wider range is refused by the device: tests/grant_exact_device.rs.)
    let (c, d) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    let g = d.grant(heap.alloc(4096).unwrap(), Access::REMOTE_WRITE).unwrap();
    assert!(matches!(c.write(&src, &g.remote(), 0), Err(Error::OutOfBounds { .. })));
    c.write(&src[..4096], &g.remote(), 0).unwrap();
    let back = g.revoke().unwrap();
    assert_bytes_eq(&back, &src[..4096], "second grant");
    // A heap without MW_BIND cannot grant.
    let plain = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    let (e, _f) = Connection::pair(&pd, &Options::default()).unwrap();
    assert!(e.grant(plain.alloc(64).unwrap(), Access::REMOTE_READ).is_err());
}

fn thread_cpu() -> Duration {
    // SAFETY: getrusage writes into the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_event_and_poller_modes_move_data_without_spinning() {
    use mralloc::transfer::{Poller, WaitMode};
    let (pd, heap) = setup();
    let poller = Poller::spawn(None).unwrap();
    for (name, wait) in [("event", WaitMode::Event), ("poller", WaitMode::Poller(poller.clone()))] {
        let mut opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
        opts.wait.mode = wait;
        let (a, b) = Connection::pair(&pd, &opts).unwrap();
        // Every kind of operation works in this mode.
        let mut src = heap.alloc(100_000).unwrap();
        src.copy_from_slice(&pattern(31, 100_000));
        let dst = heap.alloc(100_000).unwrap().expose().unwrap();
        a.write(&src, &dst.remote(), 0).unwrap();
        assert_bytes_eq(&dst.to_vec(), &src, name);
        let mut back = heap.alloc(100_000).unwrap();
        a.read(&mut back, &dst.remote(), 0).unwrap();
        assert_bytes_eq(&back, &src, name);
        let mut batch = a.batch();
        for i in 0..100 {
            batch.write(&src[1000..2000], &dst.remote(), i * 1000).unwrap();
        }
        batch.submit().unwrap();
        let dst = dst.revoke().unwrap();
        for i in 0..100 {
            assert_bytes_eq(&dst[i * 1000..(i + 1) * 1000], &src[1000..2000], &format!("{name} batch write {i}"));
        }
        // A receive that waits 600 ms for its SEND: the waiting thread sleeps.
        let (cpu, got, inbox) = std::thread::scope(|s| {
            let h = s.spawn(|| {
                let mut inbox = heap.alloc(64).unwrap();
                let before = thread_cpu();
                let got = b.recv(&mut inbox).unwrap();
                (thread_cpu() - before, got, inbox)
            });
            std::thread::sleep(Duration::from_millis(600));
            a.send(&src[..64]).unwrap();
            h.join().unwrap()
        });
        println!("{name} mode: a 600 ms receive wait used {cpu:?} of CPU");
        assert_eq!(got.len, 64);
        assert_bytes_eq(&inbox, &src[..64], &format!("{name} mode: received bytes"));
        assert!(cpu < Duration::from_millis(300), "{name} mode spun: {cpu:?} of CPU in a 600 ms wait");
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_uninit_buffers_become_the_bytes_that_arrived() {
    let (pd, heap) = setup();
    let (a, b) = Connection::pair(&pd, &rights(Access::REMOTE_READ)).unwrap();
    // Old bytes in the memory the uninitialised buffers will get.
    heap.alloc(1 << 20).unwrap().fill(0xee);
    let want = pattern(7, 1 << 20);
    let mut src = heap.alloc(1 << 20).unwrap();
    src.copy_from_slice(&want);
    let remote = src.remote().unwrap();
    // A READ fills all of its target.
    let (got, _) = a.post_read(heap.alloc_uninit(1 << 20).unwrap(), &remote, 0).unwrap().wait().unwrap();
    assert_eq!(got.init_len(), 1 << 20);
    assert_bytes_eq(&got.into_init(), &want, "read into an uninit buffer");
    // A receive: only what arrived is shown, in a buffer much larger than the message.
    let pending = b.post_recv(heap.alloc_uninit(1 << 20).unwrap()).unwrap();
    let mut msg = heap.alloc(100).unwrap();
    msg.copy_from_slice(&want[..100]);
    a.send(&msg).unwrap();
    let (got, r) = pending.wait().unwrap();
    assert_eq!((r.len, got.init_len()), (100, 100));
    let got = got.into_init();
    assert_eq!(&got[..], &want[..100]);
    // A failed READ (out of the remote key's range never posts; a bad rkey fails at the NIC)
    // gives the buffer back with nothing marked.
    let bad = RemoteBuf { rkey: remote.rkey ^ 0x5a5a_0000, ..remote };
    let pending = a.post_read(heap.alloc_uninit(4096).unwrap(), &bad, 0).unwrap();
    match pending.wait() {
        Err(r) => assert_eq!(r.buf.map(|u| u.init_len()), Some(0), "{}", r.error),
        Ok((u, _)) => panic!("a READ with a bad rkey succeeded: {u:?}"),
    }
}

/// The default wait spins briefly, then sleeps: a receive waiting a second for a quiet peer
/// costs little CPU (an idle server burns no core), where `WaitMode::BusyPoll` spins the whole
/// second. Operations that complete fast still work in both modes.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_an_idle_wait_sleeps_by_default_and_spins_only_when_asked() {
    let (pd, heap) = setup();
    for (mode, name) in [(WaitMode::Event, "default (Event)"), (WaitMode::BusyPoll, "BusyPoll")] {
        let opts = Options {
            wait: WaitOptions { mode: mode.clone(), recv_timeout: Some(Duration::from_secs(1)), ..Default::default() },
            ..Options::default()
        };
        assert!(matches!(Options::default().wait.mode, WaitMode::Event), "Event is the default");
        let (a, b) = Connection::pair(&pd, &opts).unwrap();
        // Fast operations first (the spin learns they complete quickly).
        let mut msg = heap.alloc(64).unwrap();
        msg.fill(7);
        let mut inbox = heap.alloc(64).unwrap();
        for _ in 0..50 {
            let p = b.post_recv(heap.alloc(64).unwrap()).unwrap();
            a.send(&msg).unwrap();
            assert_eq!(p.wait().unwrap().0[..], msg[..]);
        }
        let (cpu, t) = (thread_cpu(), Instant::now());
        let err = b.recv(&mut inbox).unwrap_err();
        let (cpu, wall) = (thread_cpu() - cpu, t.elapsed());
        println!("{name}: an idle receive of {wall:?} used {cpu:?} of CPU ({err})");
        assert!(matches!(err, Error::Timeout(..)), "{err:?}");
        if matches!(mode, WaitMode::Event) {
            assert!(cpu < wall / 5, "{name}: an idle wait spun: {cpu:?} of CPU in {wall:?}");
        } else {
            assert!(cpu > wall / 2, "{name}: a busy-polling wait slept: {cpu:?} of CPU in {wall:?}");
        }
    }
}

/// Several threads waiting on one connection in the default mode: one sleeps on the completion
/// channel, the others nap until a reap may have brought theirs. Idle, they all cost little
/// CPU; each still gets its own message when it comes.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_several_idle_waiters_on_one_connection_sleep() {
    let (pd, heap) = setup();
    let (a, b) = Connection::pair(&pd, &Options::default()).unwrap();
    const WAITERS: usize = 4;
    let (cpu, got) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WAITERS)
            .map(|_| {
                s.spawn(|| {
                    let mut inbox = heap.alloc(64).unwrap();
                    let before = thread_cpu();
                    let got = b.recv(&mut inbox).unwrap();
                    (thread_cpu() - before, got.len, inbox[0])
                })
            })
            .collect();
        wait_for("every waiter's receive posted", WAIT, || b.stats().recvs_in_flight == WAITERS as u32);
        std::thread::sleep(Duration::from_millis(800));
        let mut msg = heap.alloc(64).unwrap();
        for k in 0..WAITERS {
            msg.fill(k as u8 + 1);
            a.send(&msg).unwrap();
        }
        let r: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        (r.iter().map(|x| x.0).sum::<Duration>(), r.iter().map(|x| (x.1, x.2)).collect::<Vec<_>>())
    });
    println!("{WAITERS} waiters idle for 800 ms used {cpu:?} of CPU in all");
    let mut firsts: Vec<u8> = got
        .iter()
        .map(|&(len, first)| {
            assert_eq!(len, 64);
            first
        })
        .collect();
    firsts.sort();
    assert_eq!(firsts, (1..=WAITERS as u8).collect::<Vec<_>>(), "each waiter got one message");
    assert!(cpu < Duration::from_millis(400), "idle waiters spun: {cpu:?} of CPU for {WAITERS} x 800 ms");
}
