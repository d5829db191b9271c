//! What a peer's messages can make safe code see (run by `scripts/test` in the VM).
//!
//! A peer's RDMA WRITE with immediate consumes one of this side's posted receives; its
//! completion reports the WRITE's length, but the bytes went to the remote address the WRITE
//! named, none into the receive buffer. Every receive path must report "immediate only" with no
//! bytes written: an `UninitBuffer` comes back with nothing initialised, a `Buffer` unchanged,
//! and nothing next to them changes — whatever length the peer wrote (shorter or far longer than
//! the receive buffer).

mod common;

use common::*;
use mralloc::heap::{Heap, UninitBuffer};
use mralloc::transfer::{Arrival, Connection, Received};
use mralloc::verbs::{Access, Pd};
use mralloc::Buffer;

const RECV: usize = 256;
/// The peer's WRITE lengths: shorter than the receive buffer, and far longer.
const WRITES: [usize; 2] = [200, 1 << 20];

struct Setup {
    heap: Heap,
    a: Connection,
    b: Connection,
    /// Where the peer's WRITEs land (exposed on `b`'s side).
    target: mralloc::heap::Exposed,
    /// The peer's WRITE source.
    src: Buffer,
}

fn setup() -> Setup {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE).build().unwrap();
    let (a, b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    let target = heap.alloc(1 << 20).unwrap().expose().unwrap();
    let mut src = heap.alloc(1 << 20).unwrap();
    src.copy_from_slice(&pattern(7, 1 << 20));
    Setup { heap, a, b, target, src }
}

/// A buffer of `len` bytes of `byte`.
fn filled(heap: &Heap, len: usize, byte: u8) -> Buffer {
    let mut b = heap.alloc(len).unwrap();
    b.fill(byte);
    b
}

/// What every path must report for a WRITE with immediate `imm`.
fn assert_immediate_only(got: Received, imm: u32, what: &str) {
    assert_eq!(
        (got.len, got.imm, got.kind, got.is_immediate_only()),
        (0, Some(imm), Arrival::ImmediateOnly, true),
        "{what}: a WRITE with immediate wrote no byte of the receive buffer"
    );
}

/// The peer (`a`) WRITEs `n` bytes with immediate `imm` to the target, one of three ways.
fn peer_writes(s: &Setup, how: usize, n: usize, imm: u32) {
    let remote = s.target.remote();
    match how {
        0 => s.a.write_with_imm(&s.src[..n], &remote, 0, imm).unwrap(),
        1 => {
            let mut batch = s.a.batch();
            batch.write_with_imm(&s.src[..n], &remote, 0, imm).unwrap();
            batch.submit().unwrap();
        }
        _ => {
            let mut part = s.heap.alloc(n).unwrap();
            part.copy_from_slice(&s.src[..n]);
            let (_, got) = s.a.post_write_with_imm(part, &remote, 0, imm).unwrap().wait().unwrap();
            assert_eq!((got.len, got.kind), (n, Arrival::Data), "the sender's own report");
        }
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_write_with_immediate_fills_no_posted_receive() {
    let s = setup();
    let mut imm = 0x1000;
    for n in WRITES {
        for how in 0..3 {
            imm += 1;
            let what = format!("WRITE of {n} B (sender path {how})");

            // Pending, into uninitialised memory: nothing becomes initialised.
            let neighbour = filled(&s.heap, RECV, 0x77);
            let p = s.b.post_recv(s.heap.alloc_uninit(RECV).unwrap()).unwrap();
            peer_writes(&s, how, n, imm);
            let (u, got): (UninitBuffer, _) = p.wait().unwrap();
            assert_immediate_only(got, imm, &format!("Pending<UninitBuffer>, {what}"));
            assert_eq!(u.init_len(), 0, "{what}: no byte became initialised");
            assert_eq!(u.into_init().len(), 0, "{what}: into_init shows nothing");
            assert!(neighbour.iter().all(|&x| x == 0x77), "{what}: the neighbouring allocation changed");

            // Pending, into a Buffer: its bytes stay as they were.
            imm += 1;
            let p = s.b.post_recv(filled(&s.heap, RECV, 0xEE)).unwrap();
            peer_writes(&s, how, n, imm);
            let (buf, got) = p.wait().unwrap();
            assert_immediate_only(got, imm, &format!("Pending<Buffer>, {what}"));
            assert_eq!(buf.len(), RECV);
            assert!(buf.iter().all(|&x| x == 0xEE), "{what}: the receive buffer was written");

            // Blocking receive into a Buffer (the receive is posted by the spawned thread; a
            // WRITE arriving before it is retried by the transport: receiver not ready).
            imm += 1;
            let mut inbox = filled(&s.heap, RECV, 0xDD);
            std::thread::scope(|t| {
                let r = t.spawn(|| s.b.recv(&mut inbox).unwrap());
                peer_writes(&s, how, n, imm);
                assert_immediate_only(r.join().unwrap(), imm, &format!("recv, {what}"));
            });
            assert!(inbox.iter().all(|&x| x == 0xDD), "{what}: recv's buffer was written");

            // Blocking scatter receive into two parts.
            imm += 1;
            let (mut p1, mut p2) = (filled(&s.heap, RECV / 2, 0xC1), filled(&s.heap, RECV / 2, 0xC2));
            std::thread::scope(|t| {
                let r = t.spawn(|| s.b.recv(&mut [&mut p1, &mut p2]).unwrap());
                peer_writes(&s, how, n, imm);
                assert_immediate_only(r.join().unwrap(), imm, &format!("recv into a scatter list, {what}"));
            });
            assert!(p1.iter().all(|&x| x == 0xC1) && p2.iter().all(|&x| x == 0xC2), "{what}: scatter parts written");

            // The WRITE itself landed where it was sent.
            assert_bytes_eq(&s.target.to_vec()[..n], &s.src[..n], &what);
        }
    }
    // The receive byte counter counts no WRITE-with-immediate bytes.
    assert_eq!(s.b.stats().recv_bytes, 0, "receive bytes counted for WRITEs with immediate");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_send_reports_what_it_delivered() {
    // The counterpart: a SEND of 200 bytes into a 256-byte uninitialised receive initialises
    // exactly those 200 bytes.
    let s = setup();
    let p = s.b.post_recv(s.heap.alloc_uninit(RECV).unwrap()).unwrap();
    s.a.send_with_imm(&s.src[..200], 9).unwrap();
    let (u, got) = p.wait().unwrap();
    assert_eq!((got.len, got.imm, got.kind), (200, Some(9), Arrival::Data));
    assert_eq!(u.init_len(), 200);
    assert_bytes_eq(&u.into_init(), &s.src[..200], "the SEND's bytes");
    assert_eq!(s.b.stats().recv_bytes, 200);
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_write_with_immediate_fills_no_posted_receive() {
    use mralloc::transfer::AsyncConnection;
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE).build().unwrap();
    let (a, b) = AsyncConnection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    let target = heap.alloc(1 << 20).unwrap().expose().unwrap();
    for (i, n) in WRITES.into_iter().enumerate() {
        let imm = 0x2000 + i as u32;
        let neighbour = filled(&heap, RECV, 0x77);
        let recv = b.recv(heap.alloc_uninit(RECV).unwrap());
        let src = heap.alloc(n).unwrap();
        a.write_with_imm(src, &target.remote(), 0, imm).await.unwrap();
        let (u, got) = recv.await.unwrap();
        assert_immediate_only(got, imm, &format!("async recv<UninitBuffer>, WRITE of {n} B"));
        assert_eq!(u.init_len(), 0);
        assert!(neighbour.iter().all(|&x| x == 0x77));

        let recv = b.recv(filled(&heap, RECV, 0xEE));
        a.write_with_imm(heap.alloc(n).unwrap(), &target.remote(), 0, imm + 100).await.unwrap();
        let (buf, got) = recv.await.unwrap();
        assert_immediate_only(got, imm + 100, &format!("async recv<Buffer>, WRITE of {n} B"));
        assert!(buf.iter().all(|&x| x == 0xEE));
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_write_with_immediate_into_a_shared_receive_queue_delivers_no_bytes() {
    use mralloc::transfer::{Options, SharedReceiver};
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_WRITE).build().unwrap();
    let shared = SharedReceiver::new(&pd, 4, RECV).unwrap();
    let opts = Options { shared_receive: Some(shared.clone()), ..rights(Access::REMOTE_WRITE) };
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let target = heap.alloc(1 << 20).unwrap().expose().unwrap();
    for (i, n) in WRITES.into_iter().enumerate() {
        let imm = 0x3000 + i as u32;
        a.write_with_imm(&heap.alloc(n).unwrap(), &target.remote(), 0, imm).unwrap();
        let msg = shared.recv_timeout(std::time::Duration::from_secs(20)).unwrap();
        assert!(msg.is_from(&b), "the message names the connection it came over");
        assert_eq!((msg.len(), msg.imm(), msg.kind()), (0, Some(imm), Arrival::ImmediateOnly), "WRITE of {n} B");
    }
    // A SEND is data, at most the slot.
    a.send(&heap.alloc(100).unwrap()).unwrap();
    let msg = shared.recv_timeout(std::time::Duration::from_secs(20)).unwrap();
    assert_eq!((msg.len(), msg.kind()), (100, Arrival::Data));
}
