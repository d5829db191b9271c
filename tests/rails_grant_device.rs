//! Grants over rails (`Rails::grant`): one owned buffer, a window per rail, one descriptor the
//! peer's rails stripe over. Two Soft-RoCE devices in the VM (the test device and a second one
//! on a veth pair), a loopback pair on each as a rail. Run by `scripts/test`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::rails::{two, ExtraDevice, Two, LENDER};
use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, IoBuf, IoBufMut, Rails};
use mralloc::verbs::Access;
use mralloc::{Buffer, Error};

/// The group pairs of these tests.
trait Groups {
    fn groups(&self) -> (Rails, Rails);
}

impl Groups for Two {
    /// Two groups joined rail for rail: rail `i` a loopback pair on device `i`.
    fn groups(&self) -> (Rails, Rails) {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for pd in &self.pds {
            let (x, y) = Connection::pair(pd, &self.opts.conn).unwrap();
            a.push(x);
            b.push(y);
        }
        (Rails::new(a, self.opts.clone()).unwrap(), Rails::new(b, self.opts.clone()).unwrap())
    }
}

/// Whether a 4 KiB WRITE from `theirs` over rail `rail` alone, to `remote`'s rkey for that
/// rail, is refused (and the rail broken by it, as a refused request breaks an RC connection).
fn refused_on(theirs: &Rails, rail: usize, remote: &mralloc::RemoteDesc, heap: &Heap) -> bool {
    let one = theirs.rail(rail).remote_of(remote).unwrap();
    let src = heap.alloc(4096).unwrap();
    matches!(theirs.rail(rail).write(&src, &one, 0), Err(Error::Operation { .. }))
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_rails_grant_gives_a_key_per_rail_and_the_peer_stripes_over_it() {
    let t = two();
    let lender = t.heap(LENDER);
    let peer_heap = t.heap(Access::LOCAL_WRITE);
    let (ours, theirs) = t.groups();
    let len = 8 << 20;
    let mut buf = lender.alloc(len).unwrap();
    buf.fill(0);
    let posted = |rails: &Rails| (0..2).map(|i| rails.rail(i).stats().send_requests).collect::<Vec<u64>>();
    let before = posted(&ours);
    let grant = ours.grant(buf, Access::REMOTE_WRITE | Access::REMOTE_READ).map_err(|r| r.error).unwrap();
    let desc = grant.desc();
    assert_eq!(grant.rails().collect::<Vec<_>>(), [0, 1]);
    let gids: Vec<_> = desc.keys().iter().map(|k| k.gid).collect();
    assert_eq!(gids, [ours.rail(0).qp().endpoint().gid, ours.rail(1).qp().endpoint().gid], "a key per rail's device");
    assert_eq!(gids, [theirs.rail(0).peer().gid, theirs.rail(1).peer().gid], "the GIDs the peer's ends address");
    assert_ne!(gids[0], gids[1]);
    // The descriptor crosses the wire as bytes.
    let desc = mralloc::RemoteDesc::from_bytes(&desc.to_vec()).unwrap();

    let mut src = peer_heap.alloc(len).unwrap();
    src.copy_from_slice(&pattern(7, len));
    let done = theirs.post_write(src, &desc, 0).map_err(|r| r.error).unwrap().wait();
    assert!(done.is_ok(), "{done:?}");
    assert!(done.rails().iter().all(|r| r.bytes > 0), "both rails carried the write: {:?}", done.rails());
    let back = theirs.post_read(peer_heap.alloc_uninit(len).unwrap(), &desc, 0).map_err(|r| r.error).unwrap().wait();
    let (back, _) = back.into_one().unwrap();
    assert_bytes_eq(&back.into_init(), &pattern(7, len), "read back through the grant");

    // A rail the grant has a key on is not restored while the grant lives (the peer would use
    // the old QP's key on the new connection).
    let (spare, _spare_peer) = Connection::pair(&t.pds[1], &t.opts.conn).unwrap();
    let mut ours = ours;
    let e = ours.restore(1, spare).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("live grants")), "{e}");

    let buf = grant.revoke().map_err(|r| r.error).unwrap();
    assert_bytes_eq(&buf, &pattern(7, len), "the buffer back after revoke");
    let after = posted(&ours);
    assert_eq!([after[0] - before[0], after[1] - before[1]], [2, 2], "a bind and an invalidation on each rail");
    // Both keys are dead: each rail's WRITE with its old rkey is refused.
    assert!(refused_on(&theirs, 0, &desc, &peer_heap), "rail 0's key still works after revoke");
    assert!(refused_on(&theirs, 1, &desc, &peer_heap), "rail 1's key still works after revoke");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_rails_grant_skips_a_dead_rail_and_refuses_what_it_cannot_key_with_the_buffer_back() {
    let t = two();
    let lender = t.heap(LENDER);
    let peer_heap = t.heap(Access::LOCAL_WRITE);

    // Rail 0 dead: a key on rail 1 only, and the peer's transfers go there.
    let (ours, theirs) = t.groups();
    ours.rail(0).close().unwrap();
    let grant = ours.grant(lender.alloc(1 << 20).unwrap(), Access::REMOTE_WRITE).map_err(|r| r.error).unwrap();
    assert_eq!(grant.rails().collect::<Vec<_>>(), [1]);
    assert_eq!(grant.desc().keys().len(), 1);
    let mut src = peer_heap.alloc(1 << 20).unwrap();
    src.copy_from_slice(&pattern(3, 1 << 20));
    let done = theirs.post_write(src, &grant.desc(), 0).map_err(|r| r.error).unwrap().wait();
    assert!(done.is_ok(), "{done:?}");
    assert_eq!(done.rails()[1].bytes, 1 << 20, "{:?}", done.rails());
    assert_bytes_eq(&grant.revoke().map_err(|r| r.error).unwrap(), &pattern(3, 1 << 20), "written over rail 1");

    // A rail that fails after the grant: revoke kills the live key, and the dead one is dead
    // once its queue pair is flushed: the buffer comes back.
    let (ours2, theirs2) = t.groups();
    let grant = ours2.grant(lender.alloc(1 << 20).unwrap(), Access::REMOTE_WRITE).map_err(|r| r.error).unwrap();
    ours2.rail(1).close().unwrap();
    let desc = grant.desc();
    let back = grant.revoke().map_err(|r| r.error).unwrap();
    assert_eq!(back.len(), 1 << 20);
    assert!(refused_on(&theirs2, 0, &desc, &peer_heap), "rail 0's key lived on after revoke");

    // Every rail dead: RailsDown, the buffer back.
    ours.rail(1).close().unwrap();
    let r = ours.grant(lender.alloc(4096).unwrap(), Access::REMOTE_WRITE).unwrap_err();
    assert!(matches!(r.error, Error::RailsDown { ref failures } if failures.len() == 2), "{:?}", r.error);
    assert!(r.buf.is_some());

    // A heap bound to rail 0's device only: refused at rail 1, rail 0's key revoked first, the
    // buffer back.
    let (ours, theirs) = t.groups();
    let one_device = Heap::builder().bind(&t.pds[0]).access(LENDER).build().unwrap();
    let r = ours.grant(one_device.alloc(4096).unwrap(), Access::REMOTE_WRITE).unwrap_err();
    assert!(matches!(r.error, Error::NotRegistered { .. }), "{:?}", r.error);
    let back = r.buf.expect("the buffer back");
    // Rail 0's key was bound and revoked: nothing the peer guesses reaches the buffer (the
    // rkeys are not known here, so check the group still works and the buffer is whole).
    assert_eq!(back.len(), 4096);
    assert!(ours.info().iter().all(|r| r.alive), "{:?}", ours.info());
    drop(theirs);

    // Rails that present one GID (two loopback pairs on one device): refused, buffer back.
    let (a, _b) = common::rails::groups(&t.pds[0], &t.opts, 2);
    let r = a.grant(lender.alloc(4096).unwrap(), Access::REMOTE_WRITE).unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(ref m) if m.contains("GID")), "{:?}", r.error);
    assert!(r.buf.is_some());
}

/// A heap buffer whose drop is seen.
struct Seen {
    buf: Buffer,
    dropped: Arc<AtomicBool>,
}

impl Drop for Seen {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

// SAFETY: delegates to a heap Buffer, which the wrapper owns (and frees only in its own drop).
unsafe impl IoBuf for Seen {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.buf.len()
    }
}

// SAFETY: as above; the Buffer is exclusively the wrapper's.
unsafe impl IoBufMut for Seen {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.as_mut_ptr()
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_dropped_rails_grant_kills_every_key_and_frees_the_buffer_only_after() {
    let t = two();
    let lender = t.heap(LENDER);
    let peer_heap = t.heap(Access::LOCAL_WRITE);
    let (ours, theirs) = t.groups();
    let dropped = Arc::new(AtomicBool::new(false));
    let seen = Seen { buf: lender.alloc(64 << 10).unwrap(), dropped: dropped.clone() };
    let grant = ours.grant(seen, Access::REMOTE_WRITE).map_err(|r| r.error).unwrap();
    let desc = grant.desc();
    let before: Vec<u64> = (0..2).map(|i| ours.rail(i).stats().send_requests).collect();
    drop(grant); // posts both invalidations, waits for none
    let after: Vec<u64> = (0..2).map(|i| ours.rail(i).stats().send_requests).collect();
    assert_eq!([after[0] - before[0], after[1] - before[1]], [1, 1], "an invalidation posted on each rail");
    assert!(!dropped.load(Ordering::SeqCst), "freed before any invalidation was reaped");
    wait_for("the dropped grant's buffer", WAIT, || {
        (0..2).for_each(|i| drop(ours.rail(i).progress()));
        dropped.load(Ordering::SeqCst)
    });
    assert!(refused_on(&theirs, 0, &desc, &peer_heap), "rail 0's key lived on after the drop");
    assert!(refused_on(&theirs, 1, &desc, &peer_heap), "rail 1's key lived on after the drop");

    // A forgotten grant leaks its buffer and keeps its keys working; the rails go on.
    let (ours, theirs) = t.groups();
    let dropped = Arc::new(AtomicBool::new(false));
    let seen = Seen { buf: lender.alloc(4096).unwrap(), dropped: dropped.clone() };
    let grant = ours.grant(seen, Access::REMOTE_WRITE).map_err(|r| r.error).unwrap();
    let desc = grant.desc();
    std::mem::forget(grant);
    ExtraDevice::leaked(); // the grant holds the rails' connections, on both devices, for good
    let src = peer_heap.alloc(4096).unwrap();
    let done = theirs.post_write(src, &desc, 0).map_err(|r| r.error).unwrap().wait();
    assert!(done.is_ok(), "{done:?}");
    assert_eq!(done.rails().iter().filter(|r| r.bytes > 0).count(), 1, "4 KiB: one slice, one rail");
    assert!(!dropped.load(Ordering::SeqCst), "a forgotten grant's buffer was freed");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_rail_on_another_gid_index_is_keyed_by_the_gid_its_ends_present() {
    let t = two();
    let ctx = t.pds[0].context();
    let port = ctx.first_active_port().unwrap();
    let default = ctx.default_gid().unwrap();
    // Another RoCE v2 GID of the test device (the veth's IPv6 link-local address).
    let table = ctx.gid_table(port).unwrap();
    let other = table
        .iter()
        .find(|e| e.gid != default && !e.gid.is_zero() && e.kind.as_deref() == Some("RoCE v2"))
        .unwrap_or_else(|| panic!("a second RoCE v2 GID on {}: {table:?}", ctx.name()));
    let mut conn0 = t.opts.conn.clone();
    conn0.device.gid_index = Some(other.index);
    let (x0, y0) = Connection::pair(&t.pds[0], &conn0).unwrap();
    let (x1, y1) = Connection::pair(&t.pds[1], &t.opts.conn).unwrap();
    let ours = Rails::new(vec![x0, x1], t.opts.clone()).unwrap();
    let theirs = Rails::new(vec![y0, y1], t.opts.clone()).unwrap();

    let lender = t.heap(LENDER);
    let peer_heap = t.heap(Access::LOCAL_WRITE);
    let len = 2 << 20;
    let grant = ours.grant(lender.alloc(len).unwrap(), Access::REMOTE_WRITE).map_err(|r| r.error).unwrap();
    let desc = grant.desc();
    // Rail 0's key sits under the GID its ends present, not the device's default GID (which a
    // descriptor made from the device alone would name, and the peer's rail 0 would not match).
    assert_eq!(desc.keys()[0].gid, other.gid);
    assert_ne!(desc.keys()[0].gid, default);
    assert_eq!(theirs.rail(0).peer().gid, other.gid, "what the peer's end of rail 0 addresses");
    let mut src = peer_heap.alloc(len).unwrap();
    src.copy_from_slice(&pattern(9, len));
    let done = theirs.post_write(src, &desc, 0).map_err(|r| r.error).unwrap().wait();
    assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0), "both rails carried the write: {done:?}");
    let buf = grant.revoke().map_err(|r| r.error).unwrap();
    assert_bytes_eq(&buf, &pattern(9, len), "written over a rail on another GID index");
}
