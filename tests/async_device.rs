//! Async RDMA on tokio against a real device (Soft-RoCE in the VM; feature `tokio`). Run by
//! `scripts/test`.
//!
//! Every operation at 1 B .. 16 MiB with its data verified; 64 tasks on 8 connections; futures
//! cancelled mid-flight free nothing early and leak nothing; setup over TCP.
#![cfg(feature = "tokio")]

mod common;

use std::time::Duration;

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{AsyncConnection, AsyncListener, Connection, Options};
use mralloc::verbs::{Access, Pd};
use mralloc::{Buffer, Error};

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    (pd, heap)
}

fn all_rights() -> Options {
    rights(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
}

fn filled(heap: &Heap, want: &[u8]) -> Buffer {
    let mut b = heap.alloc(want.len()).unwrap();
    b.copy_from_slice(want);
    b
}

/// How long a condition these tests wait for may take.
const WITHIN: Duration = Duration::from_secs(10);

const SIZES: [usize; 6] = [1, 63, 4096, 65536, 1 << 20, 16 << 20];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_every_operation_at_every_size() {
    let (pd, heap) = setup();
    let (a, b) = AsyncConnection::pair(&pd, &all_rights()).unwrap();
    for (i, &n) in SIZES.iter().enumerate() {
        let want = pattern(i as u64, n);
        let dst = heap.alloc(n + 8).unwrap().expose().unwrap();
        let remote = dst.remote();

        // WRITE at an unaligned remote offset; the buffer comes back unchanged.
        let src = a.write(filled(&heap, &want), &remote, 8 - (i as u64 % 8)).await.unwrap();
        assert_bytes_eq(&src, &want, &format!("write {n}: the buffer back"));
        assert_bytes_eq(&dst.to_vec()[8 - i % 8..][..n], &want, &format!("write {n}"));

        // READ it back.
        let back = a.read(heap.alloc(n).unwrap(), &remote, 8 - (i as u64 % 8)).await.unwrap();
        assert_bytes_eq(&back, &want, &format!("read {n}"));

        // SEND/RECV, and SEND with immediate.
        let inbox = b.recv(heap.alloc(n).unwrap());
        let src = a.send(src).await.unwrap();
        let (inbox, got) = inbox.await.unwrap();
        assert_eq!((got.len, got.imm), (n, None));
        assert_bytes_eq(&inbox, &want, &format!("send/recv {n}"));
        let inbox = b.recv(inbox);
        let src = a.send_with_imm(src, 0xAB00 + i as u32).await.unwrap();
        let (inbox, got) = inbox.await.unwrap();
        assert_eq!((got.len, got.imm), (n, Some(0xAB00 + i as u32)));
        assert_bytes_eq(&inbox, &want, &format!("send_with_imm {n}"));

        // WRITE with immediate: the data lands and the immediate arrives.
        let dst2 = heap.alloc(n).unwrap().expose().unwrap();
        let imm = b.recv_imm();
        let src = a.write_with_imm(src, &dst2.remote(), 0, 0xC0DE_0000 + i as u32).await.unwrap();
        assert_eq!(imm.await.unwrap(), 0xC0DE_0000 + i as u32);
        assert_bytes_eq(&dst2.revoke().unwrap(), &want, &format!("write_with_imm {n}"));
        drop(src);
    }

    // Atomics on a remote word: the old values come back, the word ends as computed.
    let word = heap.alloc(64).unwrap().expose().unwrap();
    let r = word.remote();
    assert_eq!(a.fetch_add(&r, 8, 5).await.unwrap(), 0);
    assert_eq!(a.fetch_add(&r, 8, 7).await.unwrap(), 5);
    assert_eq!(a.compare_swap(&r, 8, 99, 1).await.unwrap(), 12, "no swap: the old value is not 99");
    assert_eq!(a.compare_swap(&r, 8, 12, 1000).await.unwrap(), 12, "swapped");
    let word = word.revoke().unwrap();
    assert_eq!(u64::from_ne_bytes(word[8..16].try_into().unwrap()), 1000);
    assert!(matches!(a.fetch_add(&r, 4, 1).await, Err(Error::InvalidArgument(_))), "unaligned word");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_uninit_buffers_become_the_bytes_that_arrived() {
    let (pd, heap) = setup();
    let (a, b) = AsyncConnection::pair(&pd, &all_rights()).unwrap();
    heap.alloc(1 << 20).unwrap().fill(0xee);
    let want = pattern(9, 1 << 20);
    let src = filled(&heap, &want);
    let remote = src.remote().unwrap();
    let got = a.read(heap.alloc_uninit(1 << 20).unwrap(), &remote, 0).await.unwrap();
    assert_eq!(got.init_len(), 1 << 20);
    assert_bytes_eq(&got.into_init(), &want, "async read into an uninit buffer");
    let recv = b.recv(heap.alloc_uninit(1 << 20).unwrap());
    a.send(filled(&heap, &want[..100])).await.unwrap();
    let (got, r) = recv.await.unwrap();
    assert_eq!((r.len, got.init_len()), (100, 100));
    assert_eq!(&got.into_init()[..], &want[..100]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_refusals_give_the_buffer_back() {
    let (pd, heap) = setup();
    let (a, _b) = AsyncConnection::pair(&pd, &all_rights()).unwrap();
    let dst = heap.alloc(4096).unwrap().expose().unwrap();

    // Memory of no registered heap (the test binary's allocator is not mralloc's).
    let r = a.write(vec![7u8; 100], &dst.remote(), 0).await.unwrap_err();
    assert!(matches!(r.error, Error::NotRegistered { .. }), "{}", r.error);
    assert_eq!(r.buf.unwrap(), vec![7u8; 100], "the Vec comes back untouched");

    // A remote range past the end.
    let r = a.write(heap.alloc(100).unwrap(), &dst.remote(), 4000).await.unwrap_err();
    assert!(matches!(r.error, Error::OutOfBounds { .. }), "{}", r.error);
    assert_eq!(r.buf.unwrap().len(), 100);

    // After close every operation fails at once, buffer back.
    a.close().await.unwrap();
    let r = a.read(heap.alloc(8).unwrap(), &dst.remote(), 0).await.unwrap_err();
    assert!(matches!(r.error, Error::Closed), "{}", r.error);
    assert!(r.buf.is_some());
}

/// 64 tasks on 8 connections (8 per connection, from both ends), each writing, reading back and
/// verifying its own region, exchanging messages, and counting on one shared remote word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_64_tasks_on_8_connections() {
    const ROUNDS: u64 = 20;
    const SLOT: usize = 16 << 10;
    let (pd, heap) = setup();
    let target = heap.alloc(64 * SLOT).unwrap().expose().unwrap();
    let counter = heap.alloc(8).unwrap().expose().unwrap();
    let mut tasks = Vec::new();
    let mut keep = Vec::new();
    for c in 0..8u64 {
        // Half the connections never spin: every completion comes through the driver.
        let mut opts = all_rights();
        if c % 2 == 0 {
            opts.wait.spin = Duration::ZERO;
        }
        let (x, y) = AsyncConnection::pair(&pd, &opts).unwrap();
        for t in 0..8u64 {
            let id = c * 8 + t;
            // Half the tasks drive one end, half the other; a message goes to the other end.
            let (me, peer) = if t % 2 == 0 { (x.clone(), y.clone()) } else { (y.clone(), x.clone()) };
            let (heap, remote, counter) = (heap.clone(), target.remote(), counter.remote());
            tasks.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let want = pattern(id * 1000 + round, SLOT);
                    let off = id * SLOT as u64;
                    me.write(filled(&heap, &want), &remote, off).await.unwrap();
                    let back = me.read(heap.alloc(SLOT).unwrap(), &remote, off).await.unwrap();
                    assert_bytes_eq(&back, &want, &format!("task {id} round {round}"));
                    me.fetch_add(&counter, 0, 1).await.unwrap();
                    let inbox = peer.recv(heap.alloc(16).unwrap());
                    me.send(filled(&heap, &id.to_le_bytes().repeat(2))).await.unwrap();
                    let (inbox, got) = inbox.await.unwrap();
                    // Receives on one end complete in posting order, not per task: any task
                    // of this pair may have sent the message this one received.
                    assert_eq!(got.len, 16);
                    let from = u64::from_le_bytes(inbox[..8].try_into().unwrap());
                    assert_eq!(from / 8, c, "a message from a task of this connection");
                }
            }));
        }
        keep.push((x, y));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let counter = counter.revoke().unwrap();
    assert_eq!(u64::from_ne_bytes(counter[..8].try_into().unwrap()), 64 * ROUNDS, "every fetch_add counted once");
}

/// Dropped futures (timeouts, aborted tasks) park their buffers: the memory is not reused while
/// the NIC may write it, a late SEND lands in the parked buffer and not in a new owner, and once
/// the completions are reaped and the connections gone, heap and kernel resources are back to
/// where they started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_cancelled_operations_free_nothing_early_and_leak_nothing() {
    let (pd, heap) = setup();
    let pdns = our_pdns();
    let qps_before = resources("qp", &pdns);
    let live_before = heap.stats().live_bytes;
    {
        let (a, b) = AsyncConnection::pair(&pd, &all_rights()).unwrap();

        // A receive cancelled by a timeout: its buffer stays the connection's.
        let inbox = heap.alloc(4096).unwrap();
        let parked_at = inbox.addr();
        let r = tokio::time::timeout(Duration::from_millis(20), b.recv(inbox)).await;
        assert!(r.is_err(), "nothing was sent: the receive times out");
        assert_eq!(heap.stats().live_bytes, live_before + 4096, "the cancelled receive's buffer is not freed");
        let next = heap.alloc(4096).unwrap();
        assert_ne!(next.addr(), parked_at, "the parked buffer is not handed out again");

        // A task aborted while its receive waits.
        let b2 = b.clone();
        let h2 = heap.clone();
        let task = tokio::spawn(async move { b2.recv(h2.alloc(4096).unwrap()).await.map(|(buf, _)| buf.addr()) });
        // Aborted once its receive is posted (the timed-out one above is the first).
        until(WITHIN, "the task's receive posted", || b.stats().recvs_in_flight == 2).await;
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());

        // The two parked receives take the next two SENDs (in posting order); a live receive
        // posted after them gets the third.
        let live = b.recv(next);
        for k in 1..=3u8 {
            a.send(filled(&heap, &[k; 64])).await.unwrap();
        }
        let (next, got) = live.await.unwrap();
        assert_eq!(got.len, 64);
        assert!(next[..64].iter().all(|&x| x == 3), "the live receive got the third message, not an earlier one");
        // Their completions released the parked buffers.
        until(WITHIN, "parked receives released", || heap.stats().live_bytes == live_before + 4096).await;
        drop(next);

        // A SEND the peer has no receive for stays in flight (RNR retries forever): its future
        // dropped, the buffer stays the connection's until the peer posts a receive.
        let r = tokio::time::timeout(Duration::from_millis(50), a.send(filled(&heap, &pattern(5, 8192)))).await;
        assert!(r.is_err(), "no receive at the peer: the SEND cannot complete");
        // A WRITE behind it (one queue executes in order) is certainly in flight when its
        // future is dropped: its buffer stays the connection's too, and the data lands later.
        let target = heap.alloc_zeroed(1 << 16).unwrap().expose().unwrap();
        let live_held = heap.stats().live_bytes;
        let w = filled(&heap, &pattern(6, 1 << 16));
        let w_at = w.addr();
        let r = tokio::time::timeout(Duration::from_millis(20), a.write(w, &target.remote(), 0)).await;
        assert!(r.is_err(), "the WRITE waits behind the SEND");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(heap.stats().live_bytes, live_held + (1 << 16), "the in-flight WRITE's buffer is not freed");
        let again = heap.alloc(1 << 16).unwrap();
        assert_ne!(again.addr(), w_at, "the in-flight WRITE's buffer is not handed out again");
        drop(again);
        assert!(target.to_vec().iter().all(|&x| x == 0), "the WRITE behind the held SEND has not run");
        let (inbox, got) = b.recv(heap.alloc(8192).unwrap()).await.unwrap();
        assert_eq!(got.len, 8192);
        assert_bytes_eq(&inbox, &pattern(5, 8192), "the cancelled SEND's data");
        drop(inbox);
        until(WITHIN, "the held WRITE landed", || target.to_vec() == pattern(6, 1 << 16)).await;
        drop(target);
        until(WITHIN, "in-flight SEND and WRITE released", || heap.stats().live_bytes == live_before).await;

        // A 16 MiB WRITE whose future is dropped right after the post: the data still lands,
        // and the buffer is freed once the completion is reaped.
        let dst = heap.alloc(16 << 20).unwrap().expose().unwrap();
        let want = pattern(3, 16 << 20);
        let fut = a.write(filled(&heap, &want), &dst.remote(), 0);
        drop(fut);
        until(WITHIN, "cancelled write released", || heap.stats().live_bytes == live_before + (16 << 20)).await;
        assert_bytes_eq(&dst.revoke().unwrap(), &want, "the cancelled write's data");

        // A receive left posted when the connection goes: freed by the close's flush.
        let r = tokio::time::timeout(Duration::from_millis(5), b.recv(heap.alloc(4096).unwrap())).await;
        assert!(r.is_err());
    }
    until(WITHIN, "connections closed", || heap.stats().live_bytes == live_before).await;
    until(WITHIN, "queue pairs destroyed", || resources("qp", &pdns) == qps_before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_tcp_setup_and_blocking_peer() {
    let (pd, heap) = setup();
    let listener = AsyncListener::bind("127.0.0.1:0", &pd, all_rights()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let target = heap.alloc(1 << 16).unwrap().expose().unwrap();
    let blob = target.remote().to_bytes().to_vec();

    // An async client of the async listener.
    let server = tokio::spawn(async move { listener.accept_with(&blob).await.map(|c| (c, listener)) });
    let client = AsyncConnection::connect(addr, &pd, Options::default()).await.unwrap();
    let (server_conn, listener) = server.await.unwrap().unwrap();
    let remote = mralloc::RemoteBuf::from_bytes(client.peer_blob()).unwrap();
    let want = pattern(1, 1 << 16);
    client.write(filled(&heap, &want), &remote, 0).await.unwrap();
    let inbox = server_conn.recv(heap.alloc(5).unwrap());
    client.send(filled(&heap, b"hello")).await.unwrap();
    assert_eq!(&inbox.await.unwrap().0[..], b"hello");

    // A blocking client (on its own thread) of the same async listener.
    let pd2 = pd.clone();
    let blocking = std::thread::spawn(move || {
        let c = connect_retrying(|| Connection::connect(addr, &pd2, Options::default()));
        c.peer_blob().to_vec()
    });
    let second = listener.accept_with(b"second").await.unwrap();
    assert_eq!(tokio::task::spawn_blocking(move || blocking.join().unwrap()).await.unwrap(), b"second");
    drop(second);
    assert_bytes_eq(&target.revoke().unwrap(), &want, "the async client's write");
}

/// With a one-slot send queue, requests wait for room in the order they were made and are posted
/// by the driver even while nobody polls them: the WRITE with immediate that announces 32 WRITEs
/// reaches the peer after all of them. A SEND without a receive at the peer holds the slot, so
/// the WRITEs queue for certain; on a current-thread runtime the driver runs only when the test
/// yields, so the SEND's completion is still unreaped when the announcement is called: a call
/// that took the freed slot itself would overtake the 32 waiting WRITEs.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_full_send_queue_keeps_call_order() {
    let (pd, heap) = setup();
    let mut opts = all_rights();
    opts.qp.send_depth = 1;
    opts.wait.spin = Duration::ZERO;
    let (a, b) = AsyncConnection::pair(&pd, &opts).unwrap();
    assert_eq!(a.options().qp.send_depth, 1);
    const N: usize = 32;
    const SIZE: usize = 4096;
    let dst = heap.alloc(N * SIZE).unwrap().expose().unwrap();
    let flag = heap.alloc(8).unwrap().expose().unwrap();
    let bufs: Vec<Buffer> = (0..N).map(|i| filled(&heap, &pattern(i as u64, SIZE))).collect();
    // A SEND the peer has no receive for holds the only slot (RNR retries): every WRITE queues.
    let blocker = a.send(filled(&heap, &[9; 64]));
    let writes: Vec<_> =
        bufs.into_iter().enumerate().map(|(i, buf)| a.write(buf, &dst.remote(), (i * SIZE) as u64)).collect();
    let got = b.recv(heap.alloc(64).unwrap());
    let imm = b.recv_imm();
    // Blocking on purpose: the driver cannot run; the SEND completes meanwhile, unreaped.
    std::thread::sleep(Duration::from_millis(300));
    // The announcement's call reaps that completion and finds the slot free: it must still
    // queue behind the 32 WRITEs.
    let note = a.write_with_imm(filled(&heap, &[1]), &flag.remote(), 0, 77);
    // Nothing above is polled: the driver posts each request as the previous one completes.
    assert_eq!(tokio::time::timeout(Duration::from_secs(20), imm).await.expect("the announcement").unwrap(), 77);
    let landed = dst.to_vec();
    for i in 0..N {
        assert_bytes_eq(
            &landed[i * SIZE..][..SIZE],
            &pattern(i as u64, SIZE),
            &format!("write {i} before the announcement"),
        );
    }
    for w in writes {
        w.await.unwrap();
    }
    note.await.unwrap();
    blocker.await.unwrap();
    assert_eq!(&got.await.unwrap().0[..], &[9; 64]);
}

/// Many requests left posted by dropped futures: `close` flushes them all (more than one poll's
/// worth of completions) and frees their buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_close_flushes_many_parked_requests() {
    let (pd, heap) = setup();
    let live_before = heap.stats().live_bytes;
    let mut opts = all_rights();
    opts.wait.spin = Duration::ZERO;
    let (a, b) = AsyncConnection::pair(&pd, &opts).unwrap();
    for _ in 0..40 {
        let r = tokio::time::timeout(Duration::from_millis(1), b.recv(heap.alloc(256).unwrap())).await;
        assert!(r.is_err());
    }
    assert_eq!(heap.stats().live_bytes, live_before + 40 * 256, "40 receives parked");
    tokio::time::timeout(Duration::from_secs(20), b.close()).await.expect("close completes").unwrap();
    assert_eq!(heap.stats().live_bytes, live_before, "every parked receive freed by the flush");
    let r = b.recv(heap.alloc(8).unwrap()).await.unwrap_err();
    assert!(matches!(r.error, Error::Closed), "{}", r.error);
    drop((a, r));
}

/// Async connections receive through their own queues: every async way to make one refuses
/// `Options::shared_receive` with a typed error, before any connection is made (a listener
/// that took it would hand out connections whose receives never complete).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_connections_refuse_a_shared_receive_queue() {
    let (pd, _heap) = setup();
    let shared = mralloc::transfer::SharedReceiver::new(&pd, 4, 256).unwrap();
    let opts = Options { shared_receive: Some(shared), ..all_rights() };
    let refused = |what: &str, e: mralloc::Error| {
        println!("{what}: {e}");
        assert!(matches!(&e, mralloc::Error::InvalidArgument(m) if m.contains("shared_receive")), "{what}: {e:?}");
    };
    refused("AsyncConnection::pair", AsyncConnection::pair(&pd, &opts).unwrap_err());
    refused("AsyncListener::bind", AsyncListener::bind("127.0.0.1:0", &pd, opts.clone()).await.unwrap_err());
    // A client: refused before it reaches the (plain) listener, which sees no handshake.
    let listener = AsyncListener::bind("127.0.0.1:0", &pd, all_rights()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    refused("AsyncConnection::connect", AsyncConnection::connect(addr, &pd, opts.clone()).await.unwrap_err());
    let cm = (std::env::var("MRALLOC_CM_ADDR").unwrap_or_else(|_| "127.0.0.1".into()), 0u16);
    refused(
        "AsyncCmListener::bind",
        mralloc::transfer::AsyncCmListener::bind(cm.clone(), &pd, opts.clone()).unwrap_err(),
    );
    refused("AsyncConnection::connect_cm", AsyncConnection::connect_cm(cm, &pd, opts).await.unwrap_err());
    assert_eq!(listener.failed_handshakes(), 0, "no client reached the listener");
}
