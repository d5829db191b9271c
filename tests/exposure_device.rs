//! Remote access only to what was granted (run in the Soft-RoCE VM by `scripts/test`): a
//! connection's QP lets the peer WRITE, READ or use atomics on this side's memory only when
//! `QpOptions::remote_access` asked for it, and a TCP exchange with a shared secret hands no QP
//! and no blob to a peer that does not know the secret.

mod common;

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, Options, Secret, SetupOptions};
use mralloc::verbs::{Access, Cq, Pd, Qp, QpState, RegisteredBuf, SendOp, SendWr, WcStatus};
use mralloc::{AuthFailure, Error, RemoteBuf};

/// What rxe (kernel 6.1) reports to the requester when the responder's QP lacks the right for a
/// one-sided request: the responder NAKs it as an invalid request (IB class C error).
const REFUSED: WcStatus = WcStatus::RemInvReqErr;

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    (pd, heap)
}

fn filled(heap: &Heap, n: usize, byte: u8) -> mralloc::Buffer {
    let mut b = heap.alloc(n).unwrap();
    b.fill(byte);
    b
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_connection_without_remote_rights_refuses_the_peers_write() {
    let (pd, heap) = setup();
    // The memory grants everything (its heap has ALL_REMOTE); only the connection's QP decides,
    // and the peer knows what it grants from the setup: the request is refused before it is
    // posted (what the NIC would do is shown by the verbs-level test below).
    let target = filled(&heap, 4096, 0x11).expose().unwrap();
    let remote = target.remote();
    let src = filled(&heap, 4096, 0x22);

    let (a, _b) = Connection::pair(&pd, &Options::default()).unwrap();
    let err = a.write(&src, &remote, 0).unwrap_err();
    println!("WRITE into a connection without REMOTE_WRITE: {err}");
    assert!(matches!(err, Error::NotGranted { right: Access::REMOTE_WRITE, .. }), "{err:?}");
    assert!(target.to_vec().iter().all(|&x| x == 0x11), "the refused WRITE changed the target memory");
    let mut back = filled(&heap, 4096, 0);
    let err = a.read(&mut back, &remote, 0).unwrap_err();
    assert!(matches!(err, Error::NotGranted { right: Access::REMOTE_READ, .. }), "READ: {err:?}");
    let err = a.fetch_add(&remote, 0, 1).unwrap_err();
    assert!(matches!(err, Error::NotGranted { right: Access::REMOTE_ATOMIC, .. }), "fetch-add: {err:?}");
    assert!(a.error().is_none(), "a refusal before posting fails nothing");

    // The same WRITE succeeds once the target side asked for REMOTE_WRITE...
    let (g, _h) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    g.write(&src, &remote, 0).unwrap();
    assert!(target.to_vec().iter().all(|&x| x == 0x22), "the permitted WRITE landed");
    // ...and that right is all it got: a READ is still refused.
    let err = g.read(&mut back, &remote, 0).unwrap_err();
    assert!(matches!(err, Error::NotGranted { right: Access::REMOTE_READ, .. }), "READ with only WRITE: {err:?}");

    // Write-with-immediate needs REMOTE_WRITE too; a SEND needs no right at all.
    let (i, j) = Connection::pair(&pd, &Options::default()).unwrap();
    let inbox = j.post_recv(heap.alloc(64).unwrap()).unwrap();
    i.send(&src[..64]).unwrap();
    let (inbox, got) = inbox.wait().unwrap();
    assert_eq!((got.len, inbox[0]), (64, 0x22), "a SEND into a connection without rights");
    let err = i.write_with_imm(&src, &remote, 0, 7).unwrap_err();
    assert!(matches!(err, Error::NotGranted { right: Access::REMOTE_WRITE, .. }), "write-with-imm: {err:?}");
}

/// The verbs layer's default is the same: a `QpBuilder` grants the peer nothing unless
/// `remote_access` says so.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_verbs_qp_default_grants_no_remote_rights() {
    let ctx = open();
    let pd = Pd::new(&ctx).unwrap();
    let mut src = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE).unwrap();
    src.fill(0x44);
    let mut dst = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE).unwrap();
    dst.fill(0x33);
    let dst = dst.expose(Access::ALL_REMOTE).unwrap();
    let remote = dst.mr().remote(0).unwrap();
    let sge = [src.sge(0..4096).unwrap()];
    for (granted, want) in [(None, Err(REFUSED)), (Some(Access::ALL_REMOTE), Ok(()))] {
        let (cq_a, cq_b) = (Cq::new(&ctx, 16).unwrap(), Cq::new(&ctx, 16).unwrap());
        let a = Qp::builder(&pd, &cq_a, &cq_a).build().unwrap();
        let mut b = Qp::builder(&pd, &cq_b, &cq_b);
        if let Some(access) = granted {
            b = b.remote_access(access); // LOCAL_WRITE in it is ignored: not a QP right
        }
        let b = b.build().unwrap();
        a.connect(&b.endpoint(), &Default::default()).unwrap();
        b.connect(&a.endpoint(), &Default::default()).unwrap();
        // SAFETY: src and dst outlive the completion polled below; the CPU does not touch them.
        unsafe { a.post_send(&[SendWr::new(1, &sge, SendOp::Write(remote))]).unwrap() };
        let got = cq_a.next(WAIT).unwrap().ok().map(|_| ()).map_err(|e| e.wc_status().unwrap());
        println!("verbs WRITE into a QP granted {granted:?}: {got:?}");
        assert_eq!(got, want);
        if want.is_err() {
            assert_eq!(a.state().unwrap(), QpState::Error);
            assert!(dst.to_vec().iter().all(|&x| x == 0x33), "the refused WRITE changed the target memory");
        } else {
            assert!(dst.to_vec().iter().all(|&x| x == 0x44), "the permitted WRITE landed");
        }
    }
}

fn with_secret(opts: Options, secret: &str) -> Options {
    Options { setup: SetupOptions { secret: Some(Secret::new(secret).unwrap()), ..opts.setup }, ..opts }
}

fn auth_failure<T: std::fmt::Debug>(r: mralloc::Result<T>) -> AuthFailure {
    match r {
        Err(Error::Authentication(f)) => f,
        other => panic!("expected an authentication error, got {other:?}"),
    }
}

/// One listener with a secret, clients with the wrong secret, none, and the right one (threads
/// of one process); then a listener without a secret and a client that requires one.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_shared_secret_admits_only_peers_that_hold_it() {
    let (pd, heap) = setup();
    let inbox = filled(&heap, 64 << 10, 0).expose().unwrap();
    let offer = inbox.remote().to_bytes();
    let server_opts = with_secret(rights(Access::REMOTE_WRITE), "correct horse battery staple");
    let listener = Listener::bind("127.0.0.1:0", &pd, server_opts).unwrap();
    let addr = listener.local_addr().unwrap();
    let connect = |opts: Options| std::thread::spawn(move || Connection::connect(addr, &Pd::new(&open())?, opts));

    let cases = [
        (
            "wrong secret",
            with_secret(Options::default(), "wrong horse"),
            AuthFailure::WrongSecret,
            AuthFailure::WrongSecret,
        ),
        ("no secret", Options::default(), AuthFailure::NoLocalSecret, AuthFailure::NoPeerSecret),
    ];
    for (what, opts, client_sees, server_sees) in cases {
        let client = connect(opts);
        // The refused client is the listener's record, not an accept call's error.
        let server = next_handshake_failure(&listener);
        let client = client.join().unwrap();
        println!("{what}: client: {:?}; server: {:?}", client.as_ref().err(), server.error);
        assert_eq!(auth_failure(client), client_sees, "{what}: the client's error");
        assert_eq!(auth_failure::<()>(Err(server.error)), server_sees, "{what}: the server's error");
    }
    assert_eq!(listener.failed_handshakes(), 2);

    // The right secret: connected, and the client's write lands in the offered buffer.
    let client = std::thread::spawn(move || {
        let pd = Pd::new(&open()).unwrap();
        let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE).build().unwrap();
        let opts = with_secret(Options::default(), "correct horse battery staple");
        let conn = Connection::connect(addr, &pd, opts).unwrap();
        let remote = mralloc::RemoteBuf::from_bytes(conn.peer_blob()).unwrap();
        let mut data = heap.alloc(64 << 10).unwrap();
        data.copy_from_slice(&pattern(41, 64 << 10));
        conn.write_with_imm(&data, &remote, 0, 41).unwrap();
    });
    let conn = listener.accept_with(&offer).unwrap();
    assert_eq!(conn.recv_imm().unwrap(), 41);
    client.join().unwrap();
    assert_bytes_eq(&inbox.to_vec(), &pattern(41, 64 << 10), "written by the authenticated client");

    // A client that requires a secret refuses a listener without one, and both say so.
    let open_listener = Listener::bind("127.0.0.1:0", &pd, rights(Access::REMOTE_WRITE)).unwrap();
    let addr = open_listener.local_addr().unwrap();
    let client = std::thread::spawn(move || {
        let opts = with_secret(Options::default(), "correct horse battery staple");
        Connection::connect(addr, &Pd::new(&open())?, opts)
    });
    let server = next_handshake_failure(&open_listener);
    assert_eq!(auth_failure(client.join().unwrap()), AuthFailure::NoPeerSecret);
    assert_eq!(auth_failure::<()>(Err(server.error)), AuthFailure::NoLocalSecret);
}

/// Two processes: the server (child) holds a secret; the client first tries a wrong one (both
/// fail, typed), then the right one and writes into the buffer the server offered.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_two_processes_with_right_and_wrong_secrets() {
    const SECRET: &str = "two-process secret 8c1f";
    if let Ok(port) = std::env::var("MRALLOC_SECRET_SERVER") {
        let (pd, heap) = setup();
        let inbox = filled(&heap, 1 << 20, 0).expose().unwrap();
        let opts = with_secret(rights(Access::REMOTE_WRITE), SECRET);
        let l = Listener::bind(("127.0.0.1", port.parse::<u16>().unwrap()), &pd, opts).unwrap();
        let offer = inbox.remote().to_bytes();
        // One accept call: the refused first client does not end it; the listener records it.
        let conn = l.accept_with(&offer).unwrap();
        let first = auth_failure::<()>(Err(next_handshake_failure(&l).error));
        println!("secret server: first peer refused: {first:?}");
        assert_eq!(first, AuthFailure::WrongSecret);
        let imm = conn.recv_imm().unwrap();
        let inbox = inbox.revoke().unwrap();
        assert_bytes_eq(&inbox, &pattern(43, 1 << 20), "secret server inbox");
        println!("secret server: verified {} bytes, imm {imm}", inbox.len());
        // The client leaves last: exiting while its WRITE's acknowledgement may still be on the
        // way would let its connection watcher report PeerClosed first.
        conn.send(&filled(&heap, 1, 1)).unwrap();
        return;
    }
    let port = 21000 + (std::process::id() % 20000) as u16;
    let child =
        spawn_self("device_two_processes_with_right_and_wrong_secrets", ("MRALLOC_SECRET_SERVER", port.to_string()));
    let (pd, heap) = setup();
    let wrong = connect_retrying(|| {
        match Connection::connect(("127.0.0.1", port), &pd, with_secret(Options::default(), "guess")) {
            Err(Error::Authentication(f)) => Ok(f),
            Err(e) => Err(e),
            Ok(_) => panic!("connected with a wrong secret"),
        }
    });
    assert_eq!(wrong, AuthFailure::WrongSecret);
    let conn =
        connect_retrying(|| Connection::connect(("127.0.0.1", port), &pd, with_secret(Options::default(), SECRET)));
    let remote = mralloc::RemoteBuf::from_bytes(conn.peer_blob()).unwrap();
    let mut data = heap.alloc(1 << 20).unwrap();
    data.copy_from_slice(&pattern(43, 1 << 20));
    conn.write_with_imm(&data, &remote, 0, 43).unwrap();
    conn.recv(&mut heap.alloc(1).unwrap()).unwrap(); // the server is done
    let text = finish_child(child, "server");
    assert!(text.contains("secret server: first peer refused: WrongSecret"));
    assert!(text.contains("secret server: verified 1048576 bytes, imm 43"));
}

/// A writer connection with every remote right on the target side, so only the key decides.
fn open_pair(pd: &Pd) -> (Connection, Connection) {
    Connection::pair(pd, &rights(Access::ALL_REMOTE.remote_only())).unwrap()
}

/// `Buffer::remote` hands out a key for that buffer alone: one byte before or after it, a
/// neighbour in the same chunk, and the chunk's own rkey all fail at the peer with a remote
/// access error, and nothing there changes.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_buffer_key_covers_that_buffer_only() {
    let (pd, heap) = setup();
    let before = filled(&heap, 4096, 0x01);
    let target = filled(&heap, 4096, 0x02);
    let after = filled(&heap, 4096, 0x03);
    assert_eq!(mralloc::heap::chunk_of(before.as_ptr()), mralloc::heap::chunk_of(after.as_ptr()), "one chunk");
    let chunk_rkey = target.keys().unwrap().rkey;
    let src = filled(&heap, 8192, 0xEE);

    // `remote()` is a read-only key over exactly the buffer: a peer's WRITE through it fails.
    let read_only = target.remote().unwrap();
    assert!(target.is_exposed());
    assert_eq!(target.remote().unwrap(), read_only, "a second call reuses the key");
    let (r, _s) = open_pair(&pd);
    let mut got = filled(&heap, 4096, 0);
    r.read(&mut got, &read_only, 0).unwrap();
    assert!(got.iter().all(|&x| x == 0x02), "read through the read-only key");
    let err = r.write(&src[..4096], &read_only, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "WRITE through a read-only key: {err}");
    assert!(target.iter().all(|&x| x == 0x02), "the refused WRITE changed nothing");

    // `expose()`: a key with the heap's rights (write too), over exactly the buffer.
    let target = target.expose().unwrap();
    let remote = target.remote();
    assert_ne!(remote.rkey, chunk_rkey, "not the chunk's key");
    assert_ne!(remote.rkey, read_only.rkey, "not the read-only key");

    // The whole buffer is reachable, with exactly its bounds.
    let (a, _b) = open_pair(&pd);
    a.write(&src[..4096], &remote, 0).unwrap();
    assert!(target.to_vec().iter().all(|&x| x == 0xEE));
    let mut back = filled(&heap, 4096, 0);
    a.read(&mut back, &remote, 0).unwrap();
    assert!(back.iter().all(|&x| x == 0xEE));

    // One byte outside, on either side; a neighbour; a range running over the end. The fields
    // are public, so a peer can build any of these: the device must refuse them.
    let rkey = remote.rkey;
    let probes = [
        ("the byte after", RemoteBuf { addr: target.addr() + 4096, len: 1, rkey }),
        ("the byte before", RemoteBuf { addr: target.addr() - 1, len: 1, rkey }),
        ("a neighbour", RemoteBuf { addr: after.addr(), len: 64, rkey }),
        ("a range over the end", RemoteBuf { addr: target.addr() + 4000, len: 200, rkey }),
    ];
    for (what, probe) in probes {
        let (w, _r) = open_pair(&pd);
        let err = w.write(&src[..probe.len as usize], &probe, 0).unwrap_err();
        println!("WRITE to {what}: {err}");
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "WRITE to {what}: {err}");
        let (x, _y) = open_pair(&pd);
        let mut got = filled(&heap, probe.len as usize, 0x5A);
        let err = x.read(&mut got, &probe, 0).unwrap_err();
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "READ of {what}: {err}");
        assert!(got.iter().all(|&b| b == 0x5A), "a refused READ of {what} delivered bytes");
    }
    assert!(before.iter().all(|&x| x == 0x01) && after.iter().all(|&x| x == 0x03), "neighbours unchanged");
    assert!(target.to_vec().iter().all(|&x| x == 0xEE), "the refused range-over-the-end wrote nothing");

    // The chunk's registration has no remote rights: its rkey reaches nothing.
    let chunk_key = RemoteBuf { addr: target.addr(), len: 64, rkey: chunk_rkey };
    let (c, _d) = open_pair(&pd);
    let err = c.write(&src[..64], &chunk_key, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "WRITE with the chunk rkey: {err}");
    let target = target.revoke().unwrap();
    assert!(matches!(target.remote_whole_chunk(), Err(Error::NoWholeChunkAccess)));
}

/// A freed exposed buffer, and a revoked one, are unreachable — also when the heap hands the
/// same bytes to a new owner.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_freed_or_revoked_buffer_is_unreachable() {
    let (pd, heap) = setup();
    let src = filled(&heap, 4096, 0xEE);

    let freed = filled(&heap, 4096, 0x10).expose().unwrap();
    let (addr, old) = (freed.addr(), freed.remote());
    let (a, _b) = open_pair(&pd);
    a.write(&src, &old, 0).unwrap();
    drop(freed);
    let heir = filled(&heap, 4096, 0x20);
    assert_eq!(heir.addr(), addr, "the heap reuses the freed bytes (thread cache)");
    let (c, _d) = open_pair(&pd);
    let err = c.write(&src, &old, 0).unwrap_err();
    println!("WRITE to a freed buffer: {err}");
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "WRITE to a freed buffer: {err}");
    let (e, _f) = open_pair(&pd);
    let mut got = filled(&heap, 4096, 0x5A);
    assert_eq!(e.read(&mut got, &old, 0).unwrap_err().wc_status(), Some(WcStatus::RemAccessErr));
    assert!(heir.iter().all(|&x| x == 0x20), "the new owner's bytes were reached");
    assert!(!heir.is_exposed(), "the new owner is not exposed by the old key");

    let kept = filled(&heap, 4096, 0x30).expose().unwrap();
    let first = kept.remote();
    let kept = kept.revoke().unwrap();
    assert!(!kept.is_exposed());
    let (g, _h) = open_pair(&pd);
    assert_eq!(g.write(&src, &first, 0).unwrap_err().wc_status(), Some(WcStatus::RemAccessErr));
    assert!(kept.iter().all(|&x| x == 0x30), "a revoked buffer was written");
    // Exposing it again gives a new key that works; the old one stays dead.
    let kept = kept.expose().unwrap();
    let second = kept.remote();
    assert_ne!(second.rkey, first.rkey);
    let (i, _j) = open_pair(&pd);
    i.write(&src, &second, 0).unwrap();
    assert!(kept.to_vec().iter().all(|&x| x == 0xEE));
    let (k, _l) = open_pair(&pd);
    assert_eq!(k.write(&src, &first, 0).unwrap_err().wc_status(), Some(WcStatus::RemAccessErr));
}

/// Chunk-wide keys exist only when asked for, and then reach what the docs say: the whole
/// chunk, neighbours included.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_whole_chunk_keys_only_when_asked() {
    let pd = Pd::new(&open()).unwrap();
    // SAFETY: only this test's own connections get the chunk key, and they write only into
    // buffers no reference is held to while the writes run (checked after their completion).
    let heap = unsafe { Heap::builder().bind(&pd).access(Access::ALL_REMOTE).remote_access_to_whole_chunks() }
        .build()
        .unwrap();
    let target = filled(&heap, 4096, 0x01);
    let neighbour = filled(&heap, 4096, 0x02);
    assert_eq!(mralloc::heap::chunk_of(target.as_ptr()), mralloc::heap::chunk_of(neighbour.as_ptr()), "one chunk");
    let wide = target.remote_whole_chunk().unwrap();
    assert_eq!(Some(wide.rkey), target.keys().map(|k| k.rkey));
    assert!(!target.is_exposed(), "no registration of its own");
    let src = filled(&heap, 4096, 0xEE);
    let (a, _b) = open_pair(&pd);
    a.write(&src, &wide, 0).unwrap();
    // The key is the chunk's: the neighbour is reachable through it, as documented.
    let next_door = RemoteBuf { addr: neighbour.addr(), len: 4096, rkey: wide.rkey };
    a.write(&src, &next_door, 0).unwrap();
    assert!(neighbour.iter().all(|&x| x == 0xEE));
    // Buffer::expose still confines on such a heap.
    let target = target.expose().unwrap();
    let own = target.remote();
    assert_ne!(own.rkey, wide.rkey);
    let (c, _d) = open_pair(&pd);
    let err = c.write(&src[..1], &RemoteBuf { addr: neighbour.addr(), len: 1, rkey: own.rkey }, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");
}

/// A read-write mapped file's own key lets a peer READ it, never WRITE it (it lends `&[u8]`);
/// exposed, the peer WRITEs it, and revoked, the key is dead and the bytes readable again.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_mapped_file_is_writable_by_a_peer_only_while_exposed() {
    use mralloc::transfer::MappedFile;
    let (pd, heap) = setup();
    // A local filesystem (the VM's root is 9p, which cannot map files shared).
    let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    let path = dir.join(format!("mralloc-exposed-{}.bin", std::process::id()));
    // SAFETY: the test's own file; nothing else opens it.
    let file = unsafe { MappedFile::create(&path, 4096, &pd) }.unwrap();
    let src = filled(&heap, 4096, 0x5C);

    // Its plain key: a WRITE through it fails (remote access error), nothing lands.
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE | Access::REMOTE_READ)).unwrap();
    let err = a.write(&src, &file.remote().unwrap(), 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");
    assert!(file.as_slice().iter().all(|&x| x == 0), "a refused WRITE changed the file");

    // Exposed: the WRITE lands; the bytes are read by copy meanwhile.
    let file = file.expose().unwrap();
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE | Access::REMOTE_READ)).unwrap();
    let remote = file.remote();
    a.write(&src, &remote, 0).unwrap();
    assert!(file.to_vec().iter().all(|&x| x == 0x5C));

    // Revoked: the key is dead, the file readable again.
    let file = file.revoke().unwrap();
    assert!(file.as_slice().iter().all(|&x| x == 0x5C));
    let err = a.write(&filled(&heap, 4096, 0x77), &remote, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");
    assert!(file.as_slice().iter().all(|&x| x == 0x5C), "a WRITE through a revoked key landed");
    drop(file);
    let _ = std::fs::remove_file(&path);
}

/// A RegisteredBuf that lends references refuses remote-write rights; exposed, a peer writes
/// it through its key, and revoked, the key is dead.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_registered_buf_is_writable_by_a_peer_only_while_exposed() {
    let (pd, heap) = setup();
    let r = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let buf = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_READ).unwrap();
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE | Access::REMOTE_READ)).unwrap();
    let plain = RemoteBuf { addr: buf.mr().addr(), len: 4096, rkey: buf.mr().rkey() };
    let err = a.write(&filled(&heap, 64, 0x11), &plain, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");

    let buf = buf.expose(Access::REMOTE_WRITE).unwrap();
    let (a, _b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    a.write(&filled(&heap, 64, 0x22), &buf.remote(), 0).unwrap();
    let remote = buf.remote();
    let buf = buf.revoke().unwrap();
    assert!(buf[..64].iter().all(|&x| x == 0x22) && buf[64..].iter().all(|&x| x == 0));
    let err = a.write(&filled(&heap, 64, 0x33), &remote, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");
    assert!(buf[..64].iter().all(|&x| x == 0x22), "a WRITE through a revoked key landed");
}

/// `Buffer::remote_desc`: read-only keys, one per bound device, each beside the GID a connection
/// there presents; a connection picks its key by the peer's GID and READs through it, a WRITE
/// with it is refused. A heap bound to two PDs of one device cannot make one (the keys would
/// share an identity), nor can a heap without remote rights or without a PD.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_remote_desc_keys_per_device() {
    use mralloc::RemoteDesc;
    let (pd, heap) = setup();
    let b = filled(&heap, 4096, 0x5A);
    let desc = RemoteDesc::from_bytes(&b.remote_desc().unwrap().to_vec()).unwrap();
    assert_eq!(desc.keys().len(), 1);
    assert_eq!(desc.keys()[0].gid, pd.context().default_gid().unwrap());
    let (a, _z) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE | Access::REMOTE_READ)).unwrap();
    let remote = a.remote_of(&desc).unwrap();
    assert_eq!(remote, b.remote().unwrap(), "the key Buffer::remote gives (one registration per PD)");
    let mut back = filled(&heap, 92, 0);
    a.read(&mut back, &remote.slice(4000..4096).unwrap(), 4).unwrap();
    assert!(back.iter().all(|&x| x == 0x5A));
    let err = a.write(&filled(&heap, 8, 1), &remote, 0).unwrap_err();
    assert!(matches!(err, Error::Operation { status: WcStatus::RemAccessErr, .. }), "read-only: {err:?}");
    assert!(b.iter().all(|&x| x == 0x5A));

    let twice = Heap::builder().bind(&pd).bind(&Pd::new(&open()).unwrap()).access(Access::ALL_REMOTE).build().unwrap();
    let err = twice.alloc(64).unwrap().expose().unwrap().desc().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains("one PD per device")), "{err:?}");
    let local = Heap::builder().bind(&pd).build().unwrap();
    assert!(matches!(local.alloc(64).unwrap().remote_desc(), Err(Error::NoRemoteAccess)));
    let unbound = Heap::builder().access(Access::ALL_REMOTE).build().unwrap();
    let err = unbound.alloc(64).unwrap().remote_desc().unwrap_err();
    assert!(matches!(err, Error::NotRegistered { .. }), "{err:?}");
}
