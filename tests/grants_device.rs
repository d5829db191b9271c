//! The rights each side grants travel with the setup (TCP exchange, RDMA CM private data, a
//! pair): a WRITE, READ or atomic the peer did not grant is refused before it is posted, with
//! `Error::NotGranted`, on every front end, and the connection stays usable (run in the
//! Soft-RoCE VM by `scripts/test`).

mod common;

use std::time::Duration;

use common::*;
use mralloc::heap::Heap;
#[cfg(feature = "tokio")]
use mralloc::transfer::AsyncConnection;
use mralloc::transfer::{CmListener, Connection, Listener, Options};
use mralloc::verbs::{Access, Pd, Verb};
use mralloc::{Buffer, Error};

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    (pd, heap)
}

fn filled(heap: &Heap, n: usize, byte: u8) -> Buffer {
    let mut b = heap.alloc(n).unwrap();
    b.fill(byte);
    b
}

fn not_granted(e: &Error, verb: Verb, right: Access) {
    assert!(
        matches!(e, Error::NotGranted { verb: v, right: r } if *v == verb && *r == right),
        "{verb:?} wanted NotGranted({right:?}), got {e:?}"
    );
    assert!(e.to_string().contains("QpOptions::remote_access"), "the error says where the peer grants it: {e}");
}

/// Connections of each setup path: (name, this side, its peer), both with `opts`.
fn connections(pd: &Pd, opts: &Options) -> Vec<(&'static str, Connection, Connection)> {
    let mut out = Vec::new();
    let (a, b) = Connection::pair(pd, opts).unwrap();
    out.push(("pair", a, b));
    let listener = Listener::bind("127.0.0.1:0", pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let (client, server) = std::thread::scope(|s| {
        let c = s.spawn(|| Connection::connect(addr, pd, opts.clone()).unwrap());
        let server = listener.accept().unwrap();
        (c.join().unwrap(), server)
    });
    out.push(("tcp", client, server));
    let ip = std::env::var("MRALLOC_CM_ADDR").expect("MRALLOC_CM_ADDR (scripts/softroce sets it)");
    let port = 20000 + (std::process::id() % 10000) as u16;
    let cm = CmListener::bind((ip.as_str(), port), pd, opts.clone()).unwrap();
    let (client, server) = std::thread::scope(|s| {
        let c = s.spawn(|| Connection::connect_cm((ip.as_str(), port), pd, opts.clone()).unwrap());
        let server = cm.accept().unwrap();
        (c.join().unwrap(), server)
    });
    out.push(("cm", client, server));
    out
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_request_the_peer_did_not_grant_is_refused_before_it_is_posted() {
    let (pd, heap) = setup();
    let target = filled(&heap, 4096, 0x11).expose().unwrap();
    let remote = target.remote();
    let src = filled(&heap, 4096, 0x22);
    for (how, a, b) in connections(&pd, &Options::default()) {
        assert_eq!((a.peer_grants(), b.peer_grants()), (Access::NONE, Access::NONE), "{how}");
        // Blocking.
        not_granted(&a.write(&src, &remote, 0).unwrap_err(), Verb::Write, Access::REMOTE_WRITE);
        not_granted(&a.write_with_imm(&src, &remote, 0, 1).unwrap_err(), Verb::WriteWithImm, Access::REMOTE_WRITE);
        let mut back = filled(&heap, 4096, 0);
        not_granted(&a.read(&mut back, &remote, 0).unwrap_err(), Verb::Read, Access::REMOTE_READ);
        not_granted(&a.fetch_add(&remote, 0, 1).unwrap_err(), Verb::FetchAdd, Access::REMOTE_ATOMIC);
        not_granted(&a.compare_swap(&remote, 0, 0, 1).unwrap_err(), Verb::CompareSwap, Access::REMOTE_ATOMIC);
        // Pending: the owned buffer comes back.
        let Err(r) = a.post_write(filled(&heap, 64, 0x33), &remote, 0) else { panic!("{how}: post_write posted") };
        not_granted(&r.error, Verb::Write, Access::REMOTE_WRITE);
        assert_eq!(r.buf.expect("the buffer back")[0], 0x33, "{how}");
        let Err(r) = a.post_read(filled(&heap, 64, 0x44), &remote, 0) else { panic!("{how}: post_read posted") };
        not_granted(&r.error, Verb::Read, Access::REMOTE_READ);
        assert_eq!(r.buf.expect("the buffer back")[0], 0x44, "{how}");
        // Batch: refused when added, nothing posted.
        let mut batch = a.batch();
        batch.send(&src[..8]).unwrap();
        not_granted(&batch.write(&src, &remote, 0).err().expect("refused"), Verb::Write, Access::REMOTE_WRITE);
        not_granted(&batch.read(&mut back, &remote, 0).err().expect("refused"), Verb::Read, Access::REMOTE_READ);
        drop(batch);
        let s = a.stats();
        assert_eq!((s.send_requests, s.errors), (0, 0), "{how}: nothing was posted");
        assert!(a.error().is_none() && b.error().is_none(), "{how}: the refusals failed a connection");
        assert!(target.to_vec().iter().all(|&x| x == 0x11), "{how}: the target changed");
        // Still usable: a SEND goes through.
        let inbox = b.post_recv(heap.alloc(64).unwrap()).unwrap();
        a.send(&src[..64]).unwrap();
        let (inbox, got) = inbox.wait().unwrap();
        assert_eq!((got.len, inbox[0]), (64, 0x22), "{how}");
        assert_eq!(a.stats().send_requests, 1, "{how}");
        println!("{how}: refused before posting; a SEND works afterwards");
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_peer_granting_write_only_takes_writes_and_refuses_reads() {
    let (pd, heap) = setup();
    let target = filled(&heap, 4096, 0x11).expose().unwrap();
    let remote = target.remote();
    let src = filled(&heap, 4096, 0x22);
    for (i, (how, a, b)) in connections(&pd, &rights(Access::REMOTE_WRITE)).into_iter().enumerate() {
        assert_eq!((a.peer_grants(), b.peer_grants()), (Access::REMOTE_WRITE, Access::REMOTE_WRITE), "{how}");
        let mut back = filled(&heap, 64, 0);
        not_granted(&a.read(&mut back, &remote, 0).unwrap_err(), Verb::Read, Access::REMOTE_READ);
        not_granted(&a.fetch_add(&remote, 0, 1).unwrap_err(), Verb::FetchAdd, Access::REMOTE_ATOMIC);
        let at = 1024 * (i + 1);
        a.write(&src[..128], &remote, at as u64).unwrap();
        assert_eq!(target.to_vec()[at..at + 128], [0x22; 128], "{how}: the WRITE landed");
    }
    let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let (a, _b) = Connection::pair(&pd, &rights(all)).unwrap();
    assert_eq!(a.peer_grants(), all);
    assert_eq!(a.fetch_add(&remote, 0, 1).unwrap(), 0x1111_1111_1111_1111);
}

/// Keepalive: each side's QP accepts WRITEs (the probes are zero-length WRITEs), and says so;
/// the probes, built by mralloc, are never refused: the connection stays alive across many.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_keepalive_grants_write_and_still_probes() {
    let (pd, heap) = setup();
    let opts = Options { keepalive: Some(Duration::from_millis(200)), ..Options::default() };
    for (how, a, b) in connections(&pd, &opts) {
        assert_eq!((a.peer_grants(), b.peer_grants()), (Access::REMOTE_WRITE, Access::REMOTE_WRITE), "{how}");
        std::thread::sleep(Duration::from_millis(1500));
        assert!(a.error().is_none() && b.error().is_none(), "{how}: {:?} {:?}", a.error(), b.error());
        let inbox = b.post_recv(heap.alloc(8).unwrap()).unwrap();
        a.send(&filled(&heap, 8, 1)).unwrap();
        inbox.wait().unwrap();
    }
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_requests_the_peer_did_not_grant_give_their_buffer_back() {
    let (pd, heap) = setup();
    let target = filled(&heap, 4096, 0x11).expose().unwrap();
    let remote = target.remote();
    let (a, b) = AsyncConnection::pair(&pd, &rights(Access::REMOTE_READ)).unwrap();
    assert_eq!((a.peer_grants(), b.peer_grants()), (Access::REMOTE_READ, Access::REMOTE_READ));
    let r = a.write(filled(&heap, 64, 0x55), &remote, 0).await.unwrap_err();
    not_granted(&r.error, Verb::Write, Access::REMOTE_WRITE);
    assert_eq!(r.buf.expect("the buffer back")[0], 0x55);
    let e = a.fetch_add(&remote, 0, 1).await.unwrap_err();
    not_granted(&e, Verb::FetchAdd, Access::REMOTE_ATOMIC);
    assert_eq!(a.stats().send_requests, 0, "nothing was posted");
    let back = a.read(filled(&heap, 64, 0), &remote, 0).await.unwrap();
    assert_eq!(back[0], 0x11, "the granted READ works");
}
