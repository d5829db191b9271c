//! Remote memory over async rail groups (`AsyncRails::request_remote`, `push`): one buffer of
//! the owner's heap lent through every rail, a key per rail in one descriptor the borrower's
//! rails stripe over. Two Soft-RoCE devices in the VM (the test device and a second one on a
//! veth pair), a loopback pair of async connections on each as a rail. Run by `scripts/test`.
#![cfg(feature = "tokio")]

mod common;

use std::time::Duration;

use common::rails::{two, Two, LENDER, RW};
use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{AsyncConnection, AsyncRails, RemoteLimits};
use mralloc::verbs::Access;
use mralloc::{Error, RemoteRefusal};

/// The group pairs of these tests.
trait Groups {
    fn pair(&self, i: usize) -> (AsyncConnection, AsyncConnection);
    fn groups(&self) -> (AsyncRails, AsyncRails);
}

impl Groups for Two {
    /// A new connection for rail `i`: the borrower's end and the owner's.
    fn pair(&self, i: usize) -> (AsyncConnection, AsyncConnection) {
        AsyncConnection::pair(&self.pds[i], &self.opts.conn).unwrap()
    }

    /// The borrower's group and the owner's, joined rail for rail.
    fn groups(&self) -> (AsyncRails, AsyncRails) {
        let (a, b): (Vec<_>, Vec<_>) = (0..2).map(|i| self.pair(i)).unzip();
        (AsyncRails::new(a, self.opts.clone()).unwrap(), AsyncRails::new(b, self.opts.clone()).unwrap())
    }
}

/// Buffers the owner lends through each rail now.
fn lent(owner: &AsyncRails) -> Vec<usize> {
    (0..owner.len()).map(|i| owner.rail(i).remote_memory_stats().lent_buffers).collect()
}

/// How long a condition these tests wait for may take.
const WITHIN: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_memory_lent_over_rails_is_striped_over_and_freed_when_dropped() {
    let t = two();
    let (borrower, owner) = t.groups();
    let local = t.heap(Access::LOCAL_WRITE);
    let lender = t.heap(LENDER);
    owner.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    let baseline = lender.stats().live_bytes;

    let n = (4 << 20) + 3;
    let mem = borrower.request_remote(n as u64, RW).await.unwrap();
    assert_eq!((mem.len(), mem.access()), (n as u64, RW));
    assert_eq!(mem.rails().collect::<Vec<_>>(), [0, 1], "a key per rail");
    let desc = mem.desc();
    assert_eq!(desc.keys().len(), 2);
    for (i, k) in desc.keys().iter().enumerate() {
        // Each key under the GID the borrower's end of its rail addresses.
        assert_eq!(k.gid, borrower.rail(i).peer().gid, "rail {i}'s key");
    }
    assert_eq!(lent(&owner), [1, 1], "each rail's registry holds its key");
    assert_eq!(owner.rail(1).remote_memory_stats().lent_bytes, n as u64);
    assert!(lender.stats().live_bytes >= baseline + n as u64, "the owner's heap holds it");

    // Zeroed; written striped over both rails; read back the same way.
    let (mut zero, _) = borrower.read(local.alloc_uninit(n).unwrap(), &desc, 0).await.into_result().unwrap();
    assert!(zero.pop().unwrap().into_init().iter().all(|&b| b == 0), "lent memory is zeroed");
    let mut src = local.alloc(n).unwrap();
    src.copy_from_slice(&pattern(31, n));
    let done = borrower.write(src, &desc, 0).await;
    assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0), "both rails carried slices: {done:?}");
    let (mut back, _) = borrower.read(local.alloc_uninit(n).unwrap(), &desc, 0).await.into_result().unwrap();
    assert_bytes_eq(&back.pop().unwrap().into_init(), &pattern(31, n), "striped over lent memory");

    // Dropped: every rail's key is revoked and the buffer freed.
    drop(mem);
    until(WITHIN, "the owner releases both keys and frees the buffer", || {
        lent(&owner) == [0, 0] && lender.stats().live_bytes == baseline
    })
    .await;
    // The old keys are dead on each rail (a refused access breaks that rail: checked last).
    for i in 0..2 {
        let one = borrower.rail(i).remote_of(&desc).unwrap();
        let r = borrower.rail(i).write(local.alloc(64).unwrap(), &one, 0).await;
        assert!(matches!(r, Err(ref e) if matches!(e.error, Error::Operation { .. })), "rail {i}: {r:?}");
    }

    // A cancelled request: the grant that arrives afterwards is given back at once. Once both
    // requests were granted (the owner counts what it told the peer), only the later one's
    // 1 MiB stays lent.
    let (borrower, owner) = t.groups();
    owner.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    // The request leaves when it is made; the future is dropped before it could take the
    // answer (polled once, it might already have it).
    drop(borrower.request_remote(3 << 20, RW));
    let later = borrower.request_remote(1 << 20, RW).await.unwrap();
    until(WITHIN, "both granted", || (0..2).all(|i| owner.rail(i).remote_memory_stats().lent_total == 2)).await;
    until(WITHIN, "only the later grant stays lent", || {
        (0..2).all(|i| owner.rail(i).remote_memory_stats().lent_bytes == 1 << 20)
    })
    .await;
    let stats = borrower.remote_memory_stats();
    assert_eq!((stats.held_buffers, stats.held_bytes), (1, 1 << 20), "the borrower holds the later one only");
    assert_eq!(owner.remote_memory_stats().lent_buffers, 2, "one key on each rail");
    drop(later);
    until(WITHIN, "and both freed", || lent(&owner) == [0, 0] && lender.stats().live_bytes == baseline).await;

    // A listener that serves from the start: a request right after the group is set up is
    // answered (the group's rails may get it before their side has made the group).
    let mut listener =
        mralloc::transfer::AsyncRailsListener::bind("127.0.0.1:0", &t.pds, t.opts.clone()).await.unwrap();
    listener.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    assert!(matches!(listener.serve_remote_memory(&local, RemoteLimits::default()), Err(Error::InvalidArgument(_))));
    let addr = listener.local_addr().unwrap();
    let (served, client) = tokio::join!(listener.accept(), AsyncRails::connect(addr, &t.pds, t.opts.clone()));
    let (served, client) = (served.unwrap(), client.unwrap());
    let mem = client.request_remote(4096, RW).await.unwrap();
    assert_eq!(mem.rails().collect::<Vec<_>>(), [0, 1]);
    let done = client.write(local.alloc(4096).unwrap(), &mem.desc(), 0).await;
    assert!(done.is_ok(), "{done:?}");
    drop(mem);
    until(WITHIN, "released", || served.remote_memory_stats().lent_buffers == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_memory_pushed_over_rails_carries_its_contents_and_refusals_say_why() {
    let t = two();
    let (borrower, owner) = t.groups();
    let local = t.heap(Access::LOCAL_WRITE);
    let lender = t.heap(LENDER);
    let baseline = lender.stats().live_bytes;

    // Not serving yet, then beyond the largest request.
    let e = borrower.request_remote(4096, RW).await.unwrap_err();
    assert!(matches!(e, Error::RemoteRefused { reason: RemoteRefusal::NotServing, .. }), "{e}");
    let limits = RemoteLimits { max_request: 1 << 20, ..RemoteLimits::default() };
    owner.serve_remote_memory(&lender, limits).unwrap();
    let e = borrower.request_remote(2 << 20, RW).await.unwrap_err();
    assert!(
        matches!(e, Error::RemoteRefused { reason: RemoteRefusal::TooLarge, limit, .. } if limit == 1 << 20),
        "{e}"
    );
    // A heap that cannot lend is refused when set.
    let plain = t.heap(Access::LOCAL_WRITE);
    assert!(matches!(owner.serve_remote_memory(&plain, limits), Err(Error::InvalidArgument(_))));

    // Pushed with its contents, read striped by the peer.
    let n = (2 << 20) + 5;
    let mut buf = lender.alloc(n).unwrap();
    buf.copy_from_slice(&pattern(41, n));
    owner.push(buf, Access::REMOTE_READ, 42).await.unwrap();
    assert_eq!(lent(&owner), [1, 1]);
    let (tag, mem) = borrower.pushed().await.unwrap();
    assert_eq!((tag, mem.len(), mem.access()), (42, n as u64, Access::REMOTE_READ));
    assert_eq!(mem.rails().collect::<Vec<_>>(), [0, 1]);
    let done = borrower.read(local.alloc_uninit(n).unwrap(), &mem.desc(), 0).await;
    assert!(done.rails().iter().all(|r| r.bytes > 0), "both rails carried slices: {done:?}");
    let (mut back, _) = done.into_result().unwrap();
    assert_bytes_eq(&back.pop().unwrap().into_init(), &pattern(41, n), "pushed over rails");
    drop(mem);
    until(WITHIN, "a dropped pushed handle frees the buffer", || {
        lent(&owner) == [0, 0] && lender.stats().live_bytes == baseline
    })
    .await;

    // A buffer of a heap bound to rail 0's device only: refused, every key withdrawn, the
    // buffer back.
    let one = Heap::builder().bind(&t.pds[0]).access(LENDER).build().unwrap();
    let r = owner.push(one.alloc(4096).unwrap(), Access::REMOTE_WRITE, 1).await.unwrap_err();
    assert!(matches!(r.error, Error::NotRegistered { .. }) && r.buf.is_some(), "{:?}", r.error);
    assert_eq!(lent(&owner), [0, 0], "the key made on rail 0 is withdrawn");
    // Rights other than remote read/write.
    let r = owner.push(lender.alloc(64).unwrap(), Access::REMOTE_ATOMIC, 1).await.unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)) && r.buf.is_some(), "{:?}", r.error);
    assert!(owner.info().iter().all(|r| r.alive), "refusals break no rail");

    // Pushed as soon as the owner's group is made, before the borrower has made its own: the
    // push waits on the borrower's rails until their group exists, then is delivered.
    let (a, b): (Vec<_>, Vec<_>) = (0..2).map(|i| t.pair(i)).unzip();
    let owner = AsyncRails::new(b, t.opts.clone()).unwrap();
    let mut buf = lender.alloc(4096).unwrap();
    buf.copy_from_slice(&pattern(43, 4096));
    owner.push(buf, Access::REMOTE_READ, 7).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let borrower = AsyncRails::new(a, t.opts.clone()).unwrap();
    let (tag, mem) = tokio::time::timeout(Duration::from_secs(10), borrower.pushed()).await.unwrap().unwrap();
    assert_eq!((tag, mem.rails().collect::<Vec<_>>()), (7, vec![0, 1]));
    let (mut back, _) = borrower.read(local.alloc_uninit(4096).unwrap(), &mem.desc(), 0).await.into_result().unwrap();
    assert_bytes_eq(&back.pop().unwrap().into_init(), &pattern(43, 4096), "a push that waited for the group");
    assert!(owner.info().iter().all(|r| r.alive) && borrower.info().iter().all(|r| r.alive));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_a_rail_that_fails_frees_its_key_while_the_other_keeps_working() {
    let t = two();
    let (mut borrower, mut owner) = t.groups();
    let local = t.heap(Access::LOCAL_WRITE);
    let lender = t.heap(LENDER);
    owner.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
    let baseline = lender.stats().live_bytes;

    let n = 1 << 20;
    let mem = borrower.request_remote(n as u64, RW).await.unwrap();
    let desc = mem.desc();
    // Rail 0 goes (the borrower's end closed): the owner notices and frees that key alone.
    borrower.rail(0).close().await.unwrap();
    until(WITHIN, "the owner frees rail 0's key", || lent(&owner) == [0, 1]).await;
    assert!(lender.stats().live_bytes >= baseline + n as u64, "rail 1's key keeps the buffer");
    let mut src = local.alloc(n).unwrap();
    src.copy_from_slice(&pattern(51, n));
    let done = borrower.write(src, &desc, 0).await;
    assert!(done.is_ok(), "{done:?}");
    assert!(done.rails()[0].bytes == 0 && done.rails()[1].bytes == n as u64, "all on rail 1: {done:?}");
    let (mut back, _) = borrower.read(local.alloc_uninit(n).unwrap(), &desc, 0).await.into_result().unwrap();
    assert_bytes_eq(&back.pop().unwrap().into_init(), &pattern(51, n), "over the surviving rail");

    // Rail 0 is not restored while the handle has a key on it.
    let (x, y) = t.pair(0);
    let e = borrower.restore(0, x).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("RailsRemoteMemory")), "{e}");
    drop(mem);
    until(WITHIN, "the last key's release frees the buffer", || {
        lent(&owner) == [0, 0] && lender.stats().live_bytes == baseline
    })
    .await;

    // Once dropped, both ends restore rail 0, and new memory has a key on it again.
    drop(y);
    let (x, y) = t.pair(0);
    borrower.restore(0, x).unwrap();
    owner.restore(0, y).unwrap();
    let mem = borrower.request_remote(n as u64, RW).await.unwrap();
    assert_eq!(mem.rails().collect::<Vec<_>>(), [0, 1]);
    let done = borrower.write(local.alloc(n).unwrap(), &mem.desc(), 0).await;
    assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0), "both rails again: {done:?}");
    drop(mem);
    until(WITHIN, "released after the restore", || lent(&owner) == [0, 0] && lender.stats().live_bytes == baseline)
        .await;
}
