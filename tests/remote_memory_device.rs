//! Remote memory with automatic release (feature `tokio`) against a real device (Soft-RoCE in
//! the VM). Run by `scripts/test`.
//!
//! Requested, used, dropped and freed on the peer (the peer's heap and lending stats show it);
//! refusals with typed reasons; hand-over and push; a cancelled request; a peer killed while
//! it holds remote memory (both sides release).
#![cfg(feature = "tokio")]

mod common;

use std::time::{Duration, Instant};

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{AsyncConnection, AsyncListener, Connection, Listener, Options, RemoteLimits};
use mralloc::verbs::{Access, Pd};
use mralloc::{Error, RemoteRefusal};

/// A PD and a heap whose buffers can be lent (memory windows) and used locally.
fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    (pd, heap)
}

fn rw() -> Access {
    Access::REMOTE_READ | Access::REMOTE_WRITE
}

/// How long a condition these tests wait for may take.
const WITHIN: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_remote_memory_requested_used_dropped_and_freed_on_the_peer() {
    let (pd, heap) = setup();
    let (client, server) = AsyncConnection::pair(&pd, &rights(rw())).unwrap();
    let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    server.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    let baseline = lender.stats().live_bytes;

    for (i, &n) in [1usize, 4096, 1 << 20].iter().enumerate() {
        let mem = client.request_remote(n as u64, rw()).await.unwrap();
        assert_eq!((mem.len(), mem.access()), (n as u64, rw()));
        let stats = server.remote_memory_stats();
        assert_eq!((stats.lent_buffers, stats.lent_bytes), (1, n as u64), "the owner counts what it lent");
        assert_eq!(client.remote_memory_stats().held_bytes, n as u64, "the requester counts what it holds");
        assert!(lender.stats().live_bytes >= baseline + n as u64, "the owner's heap holds it");

        // Zeroed, then written and read back through the grant.
        let zero = client.read(heap.alloc(n).unwrap(), &mem.remote(), 0).await.unwrap();
        assert!(zero.iter().all(|&b| b == 0), "granted memory is zeroed");
        let want = pattern(i as u64, n);
        let mut src = heap.alloc(n).unwrap();
        src.copy_from_slice(&want);
        client.write(src, &mem.remote(), 0).await.unwrap();
        let back = client.read(heap.alloc(n).unwrap(), &mem.remote(), 0).await.unwrap();
        assert_bytes_eq(&back, &want, &format!("remote memory of {n} bytes"));
        // Out of the granted range: refused locally.
        let past = client.write(heap.alloc(2).unwrap(), &mem.remote(), n as u64 - 1).await;
        assert!(matches!(past.unwrap_err().error, Error::OutOfBounds { .. }));

        drop(mem);
        until(WITHIN, "the owner frees dropped remote memory", || server.remote_memory_stats().lent_buffers == 0).await;
        assert_eq!(client.remote_memory_stats().held_buffers, 0);
        until(WITHIN, "the owner's heap is back to its baseline", || lender.stats().live_bytes == baseline).await;
    }

    // A revoked rkey no longer works: the write fails at the NIC (and fails the connection).
    let mem = client.request_remote(4096, rw()).await.unwrap();
    let stale = mem.remote();
    drop(mem);
    until(WITHIN, "released", || server.remote_memory_stats().lent_buffers == 0).await;
    let r = client.write(heap.alloc(64).unwrap(), &stale, 0).await;
    assert!(matches!(r.unwrap_err().error, Error::Operation { .. }), "a released grant's rkey is dead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_remote_memory_refusals_are_typed() {
    let (pd, _heap) = setup();
    let (client, server) = AsyncConnection::pair(&pd, &rights(Access::REMOTE_READ)).unwrap();
    let refused = |r: mralloc::Result<mralloc::transfer::RemoteMemory>| match r {
        Err(Error::RemoteRefused { reason, limit, .. }) => (reason, limit),
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Not serving yet.
    assert_eq!(refused(client.request_remote(64, Access::REMOTE_READ).await), (RemoteRefusal::NotServing, 0));

    let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    let limits = RemoteLimits { max_request: 1 << 20, max_bytes: 1536 << 10, max_buffers: 8 };
    server.serve_remote_memory(&lender, limits).unwrap();
    assert_eq!(refused(client.request_remote(2 << 20, Access::REMOTE_READ).await), (RemoteRefusal::TooLarge, 1 << 20));
    // The server's connection lets its peer read only.
    assert_eq!(refused(client.request_remote(64, rw()).await).0, RemoteRefusal::Rights);
    let first = client.request_remote(1 << 20, Access::REMOTE_READ).await.unwrap();
    assert_eq!(
        refused(client.request_remote(1 << 20, Access::REMOTE_READ).await),
        (RemoteRefusal::LimitReached, 512 << 10)
    );
    drop(first);
    until(WITHIN, "released", || server.remote_memory_stats().lent_buffers == 0).await;
    let again = client.request_remote(1 << 20, Access::REMOTE_READ).await.unwrap();
    drop(again);

    // Bad arguments never reach the peer.
    assert!(matches!(client.request_remote(0, Access::REMOTE_READ).await, Err(Error::InvalidArgument(_))));
    assert!(matches!(client.request_remote(8, Access::REMOTE_ATOMIC).await, Err(Error::InvalidArgument(_))));
    // A heap without memory windows cannot lend.
    let plain = Heap::builder().bind(&pd).build().unwrap();
    assert!(matches!(server.serve_remote_memory(&plain, limits), Err(Error::InvalidArgument(_))));

    // A blocking peer has no control channel.
    let l = AsyncListener::bind("127.0.0.1:0", &pd, Options::default()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let pd2 = pd.clone();
    let blocking = tokio::task::spawn_blocking(move || Connection::connect(addr, &pd2, Options::default()));
    let async_side = l.accept().await.unwrap();
    let _blocking = blocking.await.unwrap().unwrap();
    assert!(matches!(async_side.request_remote(64, Access::REMOTE_READ).await, Err(Error::NoControlChannel)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_remote_memory_hand_over_push_and_cancelled_requests() {
    let (pd, heap) = setup();
    // Over TCP this time: both ends async.
    let l = AsyncListener::bind("127.0.0.1:0", &pd, rights(rw())).await.unwrap();
    let addr = l.local_addr().unwrap();
    let (server, client) = tokio::join!(l.accept(), AsyncConnection::connect(addr, &pd, rights(rw())));
    let (server, client) = (server.unwrap(), client.unwrap());
    let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    server.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();

    // PUT: write into requested memory, hand it over with a tag; the owner keeps the contents.
    let want = pattern(5, 64 << 10);
    let mem = client.request_remote(want.len() as u64, Access::REMOTE_WRITE).await.unwrap();
    let mut src = heap.alloc(want.len()).unwrap();
    src.copy_from_slice(&want);
    client.write(src, &mem.remote(), 0).await.unwrap();
    let stale = mem.remote();
    client.hand_over(mem, 77).unwrap();
    let (tag, buf) = server.handed_over().await.unwrap();
    assert_eq!(tag, 77);
    assert_bytes_eq(&buf, &want, "handed-over contents");
    assert_eq!(server.remote_memory_stats().lent_buffers, 0, "handed over: no longer lent");
    drop(buf);

    // Push: the owner offers a buffer unasked; the peer reads it and drops the handle.
    let pushed = {
        let mut b = lender.alloc(4096).unwrap();
        b.copy_from_slice(&pattern(6, 4096));
        b
    };
    server.push(pushed, Access::REMOTE_READ, 9).await.unwrap();
    let (tag, mem) = client.pushed().await.unwrap();
    assert_eq!((tag, mem.len(), mem.access()), (9, 4096, Access::REMOTE_READ));
    let got = client.read(heap.alloc(4096).unwrap(), &mem.remote(), 0).await.unwrap();
    assert_bytes_eq(&got, &pattern(6, 4096), "pushed memory");
    drop(mem);
    until(WITHIN, "a dropped push is freed", || server.remote_memory_stats().lent_buffers == 0).await;

    // Cancelled requests: whatever the owner granted is given back.
    for _ in 0..20 {
        let r = tokio::time::timeout(Duration::from_micros(1), client.request_remote(8192, rw())).await;
        drop(r);
    }
    until(WITHIN, "grants of cancelled requests are released", || server.remote_memory_stats().lent_buffers == 0).await;
    assert_eq!(client.remote_memory_stats().held_buffers, 0);

    // The handed-over memory's rkey was revoked before the owner got the buffer back.
    let r = client.write(heap.alloc(64).unwrap(), &stale, 0).await;
    assert!(matches!(r.unwrap_err().error, Error::Operation { .. }));
    // A failed connection asks for nothing more.
    let held = client.request_remote(4096, rw()).await;
    assert!(held.is_err(), "the connection failed with the stale write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_remote_memory_close_releases_both_sides() {
    let (pd, _heap) = setup();
    let (client, server) = AsyncConnection::pair(&pd, &rights(rw())).unwrap();
    let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    server.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    client.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    let baseline = lender.stats().live_bytes;
    let a = client.request_remote(1 << 20, rw()).await.unwrap();
    let b = server.request_remote(1 << 20, rw()).await.unwrap();
    assert_eq!(lender.stats().live_bytes, baseline + (2 << 20));
    client.close().await.unwrap();
    until(WITHIN, "the closing side frees what it lent", || client.remote_memory_stats().lent_buffers == 0).await;
    until(WITHIN, "the peer frees what it lent (it was told)", || server.remote_memory_stats().lent_buffers == 0).await;
    until(WITHIN, "both heaps' buffers are freed", || lender.stats().live_bytes == baseline).await;
    assert!(server.error().is_some(), "the peer's connection is failed too");
    drop((a, b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_remote_memory_peer_killed_while_holding() {
    const NAME: &str = "device_remote_memory_peer_killed_while_holding";
    if let Ok(port) = std::env::var("MRALLOC_HOLDER") {
        // The holder: connect, ask for memory, lend some too, then wait to be killed.
        let (pd, _heap) = setup();
        let conn =
            AsyncConnection::connect(("127.0.0.1", port.parse::<u16>().unwrap()), &pd, rights(rw())).await.unwrap();
        let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
        conn.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
        let _mine = conn.request_remote(1 << 20, rw()).await.unwrap();
        let _more = conn.request_remote(4096, rw()).await.unwrap();
        println!("holding");
        tokio::time::sleep(Duration::from_secs(600)).await;
        return;
    }
    let (pd, _heap) = setup();
    let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    let baseline = lender.stats().live_bytes;
    let l = Listener::bind("127.0.0.1:0", &pd, Options::default()).unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let mut listener = AsyncListener::bind(("127.0.0.1", port), &pd, rights(rw())).await.unwrap();
    // Lends from the holder's first request on (it asks at once).
    listener.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--ignored", "--nocapture"])
        .env("MRALLOC_HOLDER", port.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let conn = listener.accept().await.unwrap();
    until(WITHIN, "the holder's requests are granted", || conn.remote_memory_stats().lent_buffers == 2).await;
    let theirs = conn.request_remote(8192, rw()).await.unwrap();
    assert_eq!(lender.stats().live_bytes, baseline + (1 << 20) + 4096);

    child.kill().unwrap(); // SIGKILL: no Bye, no release messages
    child.wait().unwrap();
    let t = Instant::now();
    until(WITHIN, "the survivor notices and frees what it lent", || conn.remote_memory_stats().lent_buffers == 0).await;
    until(WITHIN, "the survivor's heap is back to its baseline", || lender.stats().live_bytes == baseline).await;
    println!("peer killed: lent memory freed after {:?}", t.elapsed());
    assert!(conn.error().is_some(), "the data connection is failed");
    // What this side held of the dead peer's memory is only a handle now: using it fails.
    let r = conn.read(lender.alloc(64).unwrap(), &theirs.remote(), 0).await;
    assert!(r.is_err());
    assert!(conn.request_remote(64, rw()).await.is_err());
    drop(theirs);
    assert_eq!(conn.remote_memory_stats().held_buffers, 0);
}

/// RDMA CM: an async listener accepts concurrent async clients without blocking an executor
/// thread; the control channel rides in the CM's private data, so remote memory works as over
/// TCP. A blocking client (or a blocking listener) has no control channel: a typed refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_remote_memory_over_async_rdma_cm() {
    use mralloc::transfer::{AsyncCmListener, CmListener, MAX_ASYNC_CM_BLOB};
    let ip = std::env::var("MRALLOC_CM_ADDR")
        .expect("MRALLOC_CM_ADDR: an IP address of the RDMA device (scripts/softroce sets it)");
    let (pd, heap) = setup();
    let port = 20000 + (std::process::id() % 20000) as u16;
    let mut l = AsyncCmListener::bind((ip.as_str(), port), &pd, rights(rw())).unwrap();
    let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    l.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    let baseline = lender.stats().live_bytes;
    let l = std::sync::Arc::new(l);

    // Four clients connect at once; each blob (the longest an async CM request carries) names
    // its client, and the accept answers with it.
    const CLIENTS: usize = 4;
    let server = {
        let l = l.clone();
        tokio::spawn(async move {
            let mut conns = Vec::new();
            for _ in 0..CLIENTS {
                let c = l.accept().await.unwrap();
                conns.push(c);
            }
            conns
        })
    };
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let (ip, pd, heap) = (ip.clone(), pd.clone(), heap.clone());
        clients.push(tokio::spawn(async move {
            let blob = vec![i as u8; MAX_ASYNC_CM_BLOB];
            let c = AsyncConnection::connect_cm_with((ip.as_str(), port), &pd, rights(rw()), &blob).await.unwrap();
            let n = 64 << 10;
            let mem = c.request_remote(n as u64, rw()).await.unwrap();
            let want = pattern(40 + i as u64, n);
            let mut src = heap.alloc(n).unwrap();
            src.copy_from_slice(&want);
            c.write(src, &mem.remote(), 0).await.unwrap();
            let back = c.read(heap.alloc(n).unwrap(), &mem.remote(), 0).await.unwrap();
            assert_bytes_eq(&back, &want, &format!("client {i}: remote memory over RDMA CM"));
            drop(mem);
            c
        }));
    }
    let conns = tokio::time::timeout(Duration::from_secs(60), server).await.expect("four accepts").unwrap();
    let mut blobs: Vec<Vec<u8>> = conns.iter().map(|c| c.peer_blob().to_vec()).collect();
    blobs.sort();
    assert_eq!(blobs, (0..CLIENTS).map(|i| vec![i as u8; MAX_ASYNC_CM_BLOB]).collect::<Vec<_>>());
    let mut held = Vec::new();
    for c in clients {
        held.push(c.await.unwrap());
    }
    until(WITHIN, "every grant over RDMA CM is released", || {
        conns.iter().all(|c| c.remote_memory_stats().lent_buffers == 0)
    })
    .await;
    until(WITHIN, "the lender's heap is back to its baseline", || lender.stats().live_bytes == baseline).await;

    // The server side asks too: the control channel works both ways.
    held[0].serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    let peer = conns.iter().find(|c| c.peer_blob()[0] == 0).unwrap();
    let back = peer.request_remote(4096, rw()).await.unwrap();
    assert_eq!(held[0].remote_memory_stats().lent_buffers, 1);
    drop(back);
    until(WITHIN, "released", || held[0].remote_memory_stats().lent_buffers == 0).await;

    // A longer blob is refused before anything is sent.
    let long = vec![0; MAX_ASYNC_CM_BLOB + 1];
    let r = AsyncConnection::connect_cm_with((ip.as_str(), port), &pd, rights(rw()), &long).await;
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");

    // A blocking client: no control channel on either side.
    let (ip2, pd2) = (ip.clone(), pd.clone());
    let blocking = tokio::task::spawn_blocking(move || {
        Connection::connect_cm_with((ip2.as_str(), port), &pd2, rights(rw()), b"b")
    });
    let async_side = l.accept().await.unwrap();
    let _blocking = blocking.await.unwrap().unwrap();
    assert_eq!(async_side.peer_blob(), b"b");
    assert!(matches!(async_side.request_remote(64, rw()).await, Err(Error::NoControlChannel)));

    // A blocking listener ignores the offer: the async client has no control channel either.
    let port2 = port + 1;
    let (ip3, pd3) = (ip.clone(), pd.clone());
    let listener = std::thread::spawn(move || {
        let l = CmListener::bind((ip3.as_str(), port2), &pd3, rights(rw())).unwrap();
        let c = l.accept_with(b"blocking").unwrap();
        assert_eq!(c.peer_blob(), b"a");
        std::thread::sleep(Duration::from_millis(200));
    });
    let mut tries = 0;
    let c = loop {
        match AsyncConnection::connect_cm_with((ip.as_str(), port2), &pd, rights(rw()), b"a").await {
            Ok(c) => break c,
            Err(e) if tries < 50 => {
                tries += 1;
                println!("blocking listener not up yet ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("connecting to a blocking CmListener: {e}"),
        }
    };
    assert_eq!(c.peer_blob(), b"blocking");
    assert!(matches!(c.request_remote(64, rw()).await, Err(Error::NoControlChannel)));
    tokio::task::spawn_blocking(move || listener.join().unwrap()).await.unwrap();
}
