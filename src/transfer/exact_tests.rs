//! Both ways of keying a grant on a real device (the Soft-RoCE VM), whichever the device's probe
//! picks: a window over the heap chunk (the path of devices that confine windows, taken here by
//! deciding the answer for a fresh `Context` instead of probing — such windows work on rxe, they
//! just reach the chunk) and a window over an exact registration. Each grants, is written and
//! read through, is refused to another connection of the PD, and is revoked or dropped; the key
//! is dead afterwards and the buffer comes back (or is freed) with the peer's bytes. The exact
//! registration's window refuses the byte after the buffer on rxe too.

use std::time::Duration;

use crate::heap::Heap;
use crate::remote::RemoteBuf;
use crate::transfer::{Connection, Options, QpOptions, WaitOptions};
use crate::verbs::{Access, Context, Pd, WcStatus};

/// A PD on a fresh context whose windows are taken to confine (or not), a heap that can grant,
/// and options whose QPs admit remote reads and writes.
fn setup(confined: bool) -> (Pd, Heap, Options) {
    let ctx = Context::open_default().expect("an RDMA device");
    ctx.assume_windows_confined(confined);
    let pd = Pd::new(&ctx).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    let rw = Access::REMOTE_WRITE | Access::REMOTE_READ;
    (
        pd,
        heap,
        Options {
            qp: QpOptions { remote_access: rw, ..Default::default() },
            wait: WaitOptions { op_timeout: Duration::from_secs(20), ..Default::default() },
            ..Options::default()
        },
    )
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_grants_through_a_window_or_a_registration() {
    for confined in [true, false] {
        let (pd, heap, opts) = setup(confined);
        let (a, b) = Connection::pair(&pd, &opts).unwrap();
        let g = b.grant(heap.alloc_zeroed(4096).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ).unwrap();
        assert_eq!(g.over_chunk(), confined, "the key the answer asks for");
        let remote = g.remote();
        let mut src = heap.alloc(4096).unwrap();
        src.fill(0x3C);
        // Another connection of the PD (its QP admits remote writes): refused, writes nothing.
        let (third, _other) = Connection::pair(&pd, &opts).unwrap();
        let err = third.write(&src[..64], &RemoteBuf { len: 64, ..remote }, 0).unwrap_err();
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "confined {confined}: third connection: {err}");
        let mut back = heap.alloc(4096).unwrap();
        back.fill(0xFF);
        a.read(&mut back, &remote, 0).unwrap();
        assert!(back.iter().all(|&x| x == 0), "confined {confined}: the third connection wrote nothing");
        a.write(&src, &remote, 0).unwrap();
        back.fill(0);
        a.read(&mut back, &remote, 0).unwrap();
        assert!(back.iter().all(|&x| x == 0x3C), "confined {confined}: read back");
        let buf = g.revoke().unwrap();
        assert!(buf.iter().all(|&x| x == 0x3C), "confined {confined}: the granted buffer");
        let err = a.write(&src[..64], &RemoteBuf { len: 64, ..remote }, 0).unwrap_err();
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "confined {confined}: revoked: {err}");

        if !confined {
            // The window over an exact registration: one byte past the buffer is refused on
            // every device (on rxe, whose windows reach their whole region, too).
            let (p, q) = Connection::pair(&pd, &opts).unwrap();
            let g = q.grant(heap.alloc_zeroed(4096).unwrap(), Access::REMOTE_WRITE).unwrap();
            let after = RemoteBuf { addr: g.remote().addr + 4096, len: 1, rkey: g.remote().rkey };
            let err = p.write(&src[..1], &after, 0).unwrap_err();
            assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "exact: the byte after: {err}");
            drop(g);
        }

        // Dropped: the key dies (a registration at once; a window once its invalidation is
        // reaped, which revoking the next grant on the same connection waits behind).
        let (c, d) = Connection::pair(&pd, &opts).unwrap();
        let g = d.grant(heap.alloc(4096).unwrap(), Access::REMOTE_WRITE).unwrap();
        let dropped = g.remote();
        drop(g);
        let g = d.grant(heap.alloc(64).unwrap(), Access::REMOTE_WRITE).unwrap();
        drop(g.revoke().unwrap());
        let err = c.write(&src[..64], &RemoteBuf { len: 64, ..dropped }, 0).unwrap_err();
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "confined {confined}: dropped: {err}");

        // A heap without window binding grants nothing, whichever the key would be.
        let plain = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE).build().unwrap();
        let (_e, f) = Connection::pair(&pd, &opts).unwrap();
        let r = f.grant(plain.alloc(64).unwrap(), Access::REMOTE_READ);
        let rejected = r.err().expect("a heap without MW_BIND");
        assert!(matches!(rejected.error, crate::Error::InvalidArgument(_)), "{:?}", rejected.error);
        assert!(rejected.buf.is_some() && f.error().is_none(), "the buffer back, the connection fine");
    }
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_lends_through_a_window_or_a_registration() {
    use crate::transfer::{AsyncConnection, RemoteLimits};
    for confined in [true, false] {
        let (pd, heap, opts) = setup(confined);
        let (client, server) = AsyncConnection::pair(&pd, &opts).unwrap();
        server.serve_remote_memory(&heap, RemoteLimits::default()).unwrap();
        let rw = Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mem = client.request_remote(4096, rw).await.unwrap();
        // Another connection of the PD: refused inside the lent range.
        let (third, _other) = AsyncConnection::pair(&pd, &opts).unwrap();
        let r = third.write(heap.alloc(64).unwrap(), &RemoteBuf { len: 64, ..mem.remote() }, 0).await;
        let err = r.map(drop).unwrap_err().error;
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "confined {confined}: third connection: {err}");
        if !confined {
            // The window over an exact registration: one byte past the memory is refused (on a
            // pair of its own: the refusal fails it).
            let (p, q) = AsyncConnection::pair(&pd, &opts).unwrap();
            q.serve_remote_memory(&heap, RemoteLimits::default()).unwrap();
            let probe = p.request_remote(4096, Access::REMOTE_WRITE).await.unwrap();
            let after_probe = RemoteBuf { addr: probe.remote().addr + 4096, len: 1, rkey: probe.remote().rkey };
            let err = p.write(heap.alloc(1).unwrap(), &after_probe, 0).await.map(drop).unwrap_err().error;
            assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "exact: the byte after: {err}");
        }
        let mut src = heap.alloc(4096).unwrap();
        src.fill(0x6B);
        client.write(src, &mem.remote(), 0).await.unwrap();
        let back = client.read(heap.alloc_zeroed(4096).unwrap(), &mem.remote(), 0).await.unwrap();
        assert!(back.iter().all(|&x| x == 0x6B), "confined {confined}: read back");
        let stale = mem.remote();
        client.hand_over(mem, 5).unwrap();
        let (tag, buf) = server.handed_over().await.unwrap();
        assert!(tag == 5 && buf.iter().all(|&x| x == 0x6B), "confined {confined}: handed over");
        assert_eq!(server.remote_memory_stats().lent_buffers, 0);
        let r = client.write(heap.alloc(64).unwrap(), &stale, 0).await;
        let err = r.map(drop).unwrap_err().error;
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "confined {confined}: revoked: {err}");
    }
}
