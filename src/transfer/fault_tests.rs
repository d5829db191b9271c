//! Failure paths of the transfer layer on a real device (the Soft-RoCE VM): a chain the device
//! accepts only in part, failing completion polls, a panic while a blocking operation is in
//! flight. The partial post is the device's own refusal (a chain longer than its send queue);
//! the poll failures and the panic are injected, since no device fails `ibv_poll_cq` on demand.
//! Each test checks that when the call returns, nothing it posted is still outstanding.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::heap::Heap;
use crate::transfer::{Connection, Options, QpOptions, SetupOptions, WaitOptions};
use crate::verbs::{Access, Context, Pd};
use crate::Error;

fn setup() -> (Heap, Connection, Connection) {
    setup_with(Options {
        wait: WaitOptions { op_timeout: Duration::from_secs(20), ..Default::default() },
        ..Options::default()
    })
}

fn setup_with(opts: Options) -> (Heap, Connection, Connection) {
    let pd = Pd::new(&Context::open_default().expect("an RDMA device")).unwrap();
    let heap = Heap::builder()
        .bind(&pd)
        .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)
        .build()
        .unwrap();
    let opts =
        Options { qp: QpOptions { remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ, ..opts.qp }, ..opts };
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    (heap, a, b)
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_partially_accepted_chain_is_flushed_before_the_error() {
    // 120 requested: rxe's send queue holds 127 and its CQ (128 requested) 255, room for the
    // flush of every accepted request plus the marker behind them.
    let (heap, mut a, _b) = setup_with(Options {
        qp: QpOptions { send_depth: 120, ..Default::default() },
        wait: WaitOptions { op_timeout: Duration::from_secs(20), ..Default::default() },
        ..Options::default()
    });
    // Make the connection believe its queue is far deeper: a batch chunk (depth / 4) of 1024
    // requests then overflows the real send queue, and the device refuses the chain partway.
    let n = 1024;
    a.options_mut().qp.send_depth = 4 * n as u32;
    let dst = heap.alloc(64 * n).unwrap().expose().unwrap();
    let remote = dst.remote();
    let mut src = heap.alloc(64).unwrap();
    src.fill(0x5a);
    let mut batch = a.batch();
    for i in 0..n {
        batch.write(&src, &remote, (i * 64) as u64).unwrap();
    }
    let err = batch.submit().unwrap_err();
    let Error::PartialPost { posted, total, .. } = err else { panic!("expected a partial post, got {err:?}") };
    assert!(posted > 0 && posted < total && total == n, "posted {posted} of {total}");
    assert!(a.core().quiet(), "every accepted request was flushed before submit returned");
    assert!(a.error().is_some(), "the connection is failed");
    assert!(a.write(&src, &remote, 0).is_err(), "later posts fail fast");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_failing_polls_keep_an_owned_buffer_until_the_flush() {
    let (heap, a, _b) = setup();
    let dst = heap.alloc(1 << 20).unwrap().expose().unwrap();
    let remote = dst.remote();
    let p = a.post_write(heap.alloc(1 << 20).unwrap(), &remote, 0).unwrap();
    a.core().fail_polls.store(3, Ordering::Relaxed);
    let rej = p.wait().unwrap_err();
    assert!(matches!(rej.error, Error::Verbs { verb: "ibv_poll_cq", .. }), "{:?}", rej.error);
    assert!(rej.buf.is_some(), "the flush came: the buffer is handed back");
    assert!(a.core().quiet(), "the write's completion was reaped before its buffer came back");
    assert!(a.error().is_some());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_failing_polls_keep_a_borrow_until_the_flush() {
    let (heap, a, _b) = setup();
    let dst = heap.alloc(1 << 20).unwrap().expose().unwrap();
    let remote = dst.remote();
    let src = heap.alloc(1 << 20).unwrap();
    a.core().fail_polls.store(2, Ordering::Relaxed);
    let err = a.write(&src, &remote, 0).unwrap_err();
    assert!(matches!(err, Error::Verbs { verb: "ibv_poll_cq", .. }), "{err:?}");
    assert!(a.core().quiet(), "the write was reaped before the borrow ended");
}

/// A single failed poll — the first look of a wait, which claims a completion already there
/// without entering the loop — fails the connection as one in the loop does (a provider may
/// have lost completions in it), for a borrowed and an owned operation alike.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_one_failing_poll_at_the_first_look_fails_the_wait() {
    let (heap, a, _b) = setup();
    let dst = heap.alloc(1 << 20).unwrap().expose().unwrap();
    let remote = dst.remote();
    let src = heap.alloc(1 << 20).unwrap();
    a.core().fail_polls.store(1, Ordering::Relaxed);
    let err = a.write(&src, &remote, 0).unwrap_err();
    assert!(matches!(err, Error::Verbs { verb: "ibv_poll_cq", .. }), "blocking: {err:?}");
    assert!(a.core().quiet() && a.error().is_some(), "blocking: reaped, and the connection failed");
    let (heap, c, _d) = setup();
    let dst = heap.alloc(1 << 20).unwrap().expose().unwrap();
    let p = c.post_write(heap.alloc(1 << 20).unwrap(), &dst.remote(), 0).unwrap();
    c.core().fail_polls.store(1, Ordering::Relaxed);
    let rej = p.wait().unwrap_err();
    assert!(matches!(rej.error, Error::Verbs { verb: "ibv_poll_cq", .. }), "Pending: {:?}", rej.error);
    assert!(rej.buf.is_some() && c.core().quiet() && c.error().is_some(), "Pending: flushed, buffer back");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_unwinding_out_of_a_blocking_receive_waits_for_its_flush() {
    let (heap, _a, b) = setup();
    let mut inbox = heap.alloc(4096).unwrap();
    b.core().panic_in_wait.store(true, Ordering::Relaxed);
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| b.recv(&mut inbox)));
    assert!(r.is_err(), "the injected panic unwound out of recv");
    assert!(b.core().quiet(), "the posted receive was flushed before the borrow of `inbox` ended");
    assert!(b.error().is_some(), "the connection was failed to flush it");
}

/// A client whose endpoint the device refuses (connecting the server's QP to it fails: an
/// unroutable GID on a device that resolves addresses then) is that client's failure: the accept
/// call goes on and returns the next client; the failure is recorded.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_client_endpoint_the_device_refuses_ends_no_accept_call() {
    use crate::transfer::setup::control::REFUSE_CLIENT_ENDPOINT;
    use crate::transfer::Listener;
    let pd = Pd::new(&Context::open_default().expect("an RDMA device")).unwrap();
    let opts = Options {
        setup: SetupOptions { connect_timeout: Duration::from_secs(5), ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept_with(b"for the second"));
        REFUSE_CLIENT_ENDPOINT.store(true, Ordering::Relaxed);
        let refused = Connection::connect(addr, &pd, opts.clone());
        assert!(refused.is_err(), "the refused client's setup fails at its end too");
        assert!(!REFUSE_CLIENT_ENDPOINT.load(Ordering::Relaxed), "the server's handshake met the hook");
        let start = std::time::Instant::now();
        while listener.failed_handshakes() == 0 {
            assert!(start.elapsed() < Duration::from_secs(10), "the refused client was not recorded");
            std::thread::sleep(Duration::from_millis(5));
        }
        let f = listener.take_handshake_failures().remove(0);
        assert!(matches!(f.error, Error::Verbs { verb: "ibv_modify_qp", .. }), "{:?}", f.error);
        assert!(!server.is_finished(), "the refused client ended the accept call");
        let conn = Connection::connect(addr, &pd, opts.clone()).unwrap();
        assert_eq!(conn.peer_blob(), b"for the second");
        server.join().unwrap().expect("the accept call returns the next client");
    });
}
