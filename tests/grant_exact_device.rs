//! Grants and lent remote memory reach exactly their bytes on every device (run in the Soft-RoCE
//! VM by `scripts/test`). rxe (Linux 6.1) checks a type 2 memory window only against the region
//! under it — a whole heap chunk — so a grant there must not be a window: a peer's WRITE one byte
//! past the granted range, one byte before it, or into a neighbouring allocation of the same
//! chunk is refused (REM_ACCESS_ERR, the peer's connection fails) and changes nothing; a WRITE
//! inside the range succeeds.

mod common;

use std::time::Instant;

use common::*;
use mralloc::heap::{chunk_of, Heap};
use mralloc::transfer::Connection;
use mralloc::verbs::{Access, Pd, WcStatus};
use mralloc::{Buffer, Error, RemoteBuf};

const LEN: usize = 4096;

/// A heap whose buffers can be granted (windows where they confine, else exact registrations).
fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
    (pd, heap)
}

fn filled(heap: &Heap, n: usize, byte: u8) -> Buffer {
    let mut b = heap.alloc(n).unwrap();
    b.fill(byte);
    b
}

/// Three adjacent `LEN`-byte allocations of `heap` (one chunk): before, target, after, filled
/// with 0xB0, 0x00 and 0xA0.
fn adjacent_triple(heap: &Heap) -> (Buffer, Buffer, Buffer) {
    let mut bufs: Vec<Buffer> = (0..24).map(|_| filled(heap, LEN, 0)).collect();
    bufs.sort_by_key(Buffer::addr);
    let i = (0..bufs.len() - 2)
        .find(|&i| {
            bufs[i].addr() + LEN as u64 == bufs[i + 1].addr() && bufs[i + 1].addr() + LEN as u64 == bufs[i + 2].addr()
        })
        .expect("three adjacent 4 KiB allocations");
    let mut rest = bufs.drain(i..i + 3);
    let (mut before, target, mut after) = (rest.next().unwrap(), rest.next().unwrap(), rest.next().unwrap());
    before.fill(0xB0);
    after.fill(0xA0);
    assert_eq!(chunk_of(before.as_ptr()), chunk_of(after.as_ptr()), "one chunk");
    (before, target, after)
}

/// What a peer can build by hand (RemoteBuf's fields are public) with a granted key.
const PROBES: [&str; 4] = ["the byte after", "the byte before", "a range over the end", "a neighbour"];

/// Probe `i` of [`PROBES`] against `remote`: one byte past the range, one byte before it, a
/// range running over the end, a neighbour's first bytes.
fn outside(remote: RemoteBuf, neighbour: u64, i: usize) -> RemoteBuf {
    let RemoteBuf { addr, len, rkey } = remote;
    [
        RemoteBuf { addr: addr + len, len: 1, rkey },
        RemoteBuf { addr: addr - 1, len: 1, rkey },
        RemoteBuf { addr: addr + len - 8, len: 16, rkey },
        RemoteBuf { addr: neighbour, len: 64, rkey },
    ][i]
}

/// `Connection::grant`: a peer writes exactly the granted bytes, nothing around them.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_grant_reaches_exactly_the_granted_bytes() {
    let (pd, heap) = setup();
    // The probe that decides how grants are keyed (once per opened device), and its cost.
    let started = Instant::now();
    let confined = pd.context().confines_memory_windows();
    let probe = started.elapsed();
    // Measured, not guessed: a second opened device (a Context of its own, probed afresh) gets
    // the same answer.
    let again = open();
    let started = Instant::now();
    assert_eq!(again.confines_memory_windows(), confined, "a second probe of the device agrees");
    let probe2 = started.elapsed();
    // Cached: asking again probes nothing (far below a probe's milliseconds).
    let started = Instant::now();
    for _ in 0..100 {
        assert_eq!(pd.context().confines_memory_windows(), confined);
    }
    let cached = started.elapsed() / 100;
    println!("{} confines memory windows: {confined} (probes {probe:?}, {probe2:?}; cached {cached:?})", device_name());
    assert!(cached * 20 < probe.min(probe2), "a cached answer ({cached:?}) costs no probe ({probe:?}, {probe2:?})");
    let src = filled(&heap, 2 * LEN, 0xEE);
    let opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
    for (i, what) in PROBES.into_iter().enumerate() {
        // A fresh connection (and grant) per refused attempt: the refusal fails both ends.
        let (before, target, after) = adjacent_triple(&heap);
        let (a, b) = Connection::pair(&pd, &opts).unwrap();
        let g = b.grant(target, Access::REMOTE_WRITE).unwrap();
        let remote = g.remote();
        let probe = outside(remote, after.addr(), i);
        let r = a.write(&src[..probe.len as usize], &probe, 0);
        println!("WRITE to {what} of a grant: {r:?}");
        let err = r.expect_err("a WRITE outside the grant must be refused");
        assert!(matches!(err, Error::Operation { .. }), "{what}: {err:?}");
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{what}: {err}");
        assert!(a.error().is_some(), "the refused peer's connection failed");
        assert!(before.iter().all(|&x| x == 0xB0), "{what}: the allocation before is unchanged");
        assert!(after.iter().all(|&x| x == 0xA0), "{what}: the allocation after is unchanged");
        drop(g);
    }

    // Inside the range: every byte, and back.
    let (before, target, after) = adjacent_triple(&heap);
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let g = b.grant(target, Access::REMOTE_WRITE | Access::REMOTE_READ).unwrap();
    let want = pattern(33, LEN);
    let mut data = heap.alloc(LEN).unwrap();
    data.copy_from_slice(&want);
    a.write(&data, &g.remote(), 0).unwrap();
    let mut back = filled(&heap, LEN, 0);
    a.read(&mut back, &g.remote(), 0).unwrap();
    assert_bytes_eq(&back, &want, "read back through the grant");
    let remote = g.remote();
    let target = g.revoke().unwrap();
    assert_bytes_eq(&target, &want, "the granted buffer");
    assert!(before.iter().all(|&x| x == 0xB0) && after.iter().all(|&x| x == 0xA0), "neighbours unchanged");
    // Revoked: the key is dead.
    let err = a.write(&data[..64], &RemoteBuf { len: 64, ..remote }, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "revoked grant: {err}");

    // What a grant costs now (grant + revoke of 4 KiB, and dropped instead of revoked).
    let (_a, b) = Connection::pair(&pd, &opts).unwrap();
    let mut buf = Some(heap.alloc(LEN).unwrap());
    let started = Instant::now();
    for _ in 0..20 {
        let g = b.grant(buf.take().unwrap(), Access::REMOTE_WRITE).unwrap();
        buf = Some(g.revoke().unwrap());
    }
    let revoked = started.elapsed() / 20;
    let started = Instant::now();
    for _ in 0..20 {
        drop(b.grant(heap.alloc(LEN).unwrap(), Access::REMOTE_WRITE).unwrap());
    }
    println!("grant + revoke of {LEN} B: {revoked:?}; grant + drop: {:?}", started.elapsed() / 20);

    // A heap whose chunks carry remote rights (their rkey is real, not 0 as above): a grant's
    // key is not the chunk's, and still refuses the byte after the buffer.
    let builder = Heap::builder().bind(&pd).access(Access::REMOTE_WRITE | Access::MW_BIND);
    // SAFETY: the chunks' keys are compared here only, never handed to a peer.
    let open_heap = unsafe { builder.remote_access_to_whole_chunks() }.build().unwrap();
    let buf = filled(&open_heap, LEN, 0);
    let chunk = open_heap.keys(buf.as_ptr()).unwrap();
    assert_ne!(chunk.rkey, 0, "the chunk has a remote key");
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let g = b.grant(buf, Access::REMOTE_WRITE).unwrap();
    assert!(g.remote().rkey != chunk.rkey && g.remote().rkey != chunk.lkey, "a key of its own");
    let err = a.write(&src[..1], &outside(g.remote(), 0, 0), 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "the byte after, on a remote heap: {err}");
}

#[cfg(feature = "tokio")]
mod lent {
    use super::*;
    use mralloc::transfer::{AsyncConnection, RemoteLimits};

    /// The lent buffer's neighbours: every byte within `LEN` of it on either side, read through
    /// the chunk (which stays mapped while the heap lives).
    fn around(remote: RemoteBuf) -> (Vec<u8>, Vec<u8>) {
        let (addr, len) = (remote.addr as usize, remote.len as usize);
        // SAFETY: both ranges lie inside the lender heap's chunk (asserted by the caller), which
        // stays mapped while the heap lives; only the device writes there, and only through a
        // key that covers them (none, if grants are exact).
        unsafe {
            (
                std::slice::from_raw_parts((addr - LEN) as *const u8, LEN).to_vec(),
                std::slice::from_raw_parts((addr + len) as *const u8, LEN).to_vec(),
            )
        }
    }

    /// Remote memory lent by the peer (`request_remote`, `push`): exactly its bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run scripts/test"]
    async fn device_lent_memory_reaches_exactly_the_lent_bytes() {
        let (pd, heap) = setup();
        let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
        // Neighbours of the lender's own, in its chunk.
        let victims: Vec<Buffer> = (0..8).map(|_| filled(&lender, LEN, 0x5C)).collect();
        let opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
        for (i, what) in PROBES.into_iter().enumerate() {
            let (client, server) = AsyncConnection::pair(&pd, &opts).unwrap();
            server.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
            let mem = client.request_remote(LEN as u64, Access::REMOTE_WRITE).await.unwrap();
            let remote = mem.remote();
            assert_eq!(chunk_of(remote.addr as *const u8), chunk_of(victims[0].as_ptr()), "one chunk");
            assert_eq!(chunk_of((remote.addr - LEN as u64) as *const u8), chunk_of(victims[0].as_ptr()));
            assert_eq!(chunk_of((remote.addr + 2 * LEN as u64) as *const u8), chunk_of(victims[0].as_ptr()));
            let (was_before, was_after) = around(remote);
            let probe = outside(remote, victims[i].addr(), i);
            let r = client.write(filled(&heap, probe.len as usize, 0xEE), &probe, 0).await;
            let err = r.map(drop).expect_err("a WRITE outside the lent memory must be refused").error;
            println!("WRITE to {what} of lent memory: {err}");
            assert!(matches!(err, Error::Operation { .. }), "{what}: {err:?}");
            assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{what}: {err}");
            let (now_before, now_after) = around(remote);
            assert_bytes_eq(&now_before, &was_before, &format!("{what}: the bytes before"));
            assert_bytes_eq(&now_after, &was_after, &format!("{what}: the bytes after"));
            assert!(victims.iter().all(|v| v.iter().all(|&x| x == 0x5C)), "{what}: the lender's buffers unchanged");
            drop(mem);
        }

        // A pushed buffer: one byte past it is refused too.
        let (client, server) = AsyncConnection::pair(&pd, &opts).unwrap();
        server.push(filled(&lender, LEN, 0), Access::REMOTE_WRITE, 1).await.unwrap();
        let (_, mem) = client.pushed().await.unwrap();
        let remote = mem.remote();
        let (was_before, was_after) = around(remote);
        let probe = outside(remote, 0, 0);
        let err = client.write(filled(&heap, 1, 0xEE), &probe, 0).await.map(drop).unwrap_err().error;
        println!("WRITE to the byte after a pushed buffer: {err}");
        assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "pushed: {err}");
        assert_eq!(around(remote), (was_before, was_after), "pushed: the bytes around it unchanged");

        // Inside: the whole lent range, read back.
        let (client, server) = AsyncConnection::pair(&pd, &opts).unwrap();
        server.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
        let mem = client.request_remote(LEN as u64, Access::REMOTE_WRITE | Access::REMOTE_READ).await.unwrap();
        let (was_before, was_after) = around(mem.remote());
        let want = pattern(34, LEN);
        let mut data = heap.alloc(LEN).unwrap();
        data.copy_from_slice(&want);
        client.write(data, &mem.remote(), 0).await.unwrap();
        let back = client.read(heap.alloc(LEN).unwrap(), &mem.remote(), 0).await.unwrap();
        assert_bytes_eq(&back, &want, "read back through the lent memory");
        assert_eq!(around(mem.remote()), (was_before, was_after), "the bytes around it unchanged");
        assert!(victims.iter().all(|v| v.iter().all(|&x| x == 0x5C)), "the lender's buffers unchanged");
    }
}

/// fork(): a child's copies of a grant revoke and release nothing of the parent's — the key
/// (here a registration of the buffer, on devices that do not confine windows) stays alive in
/// the parent, whose peer still writes through it, and the parent revokes it afterwards.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_forked_childs_copy_of_a_grant_leaves_the_parents_key_alone() {
    let (pd, heap) = setup();
    let (a, b) = Connection::pair(&pd, &rights(Access::REMOTE_WRITE)).unwrap();
    let g = b.grant(filled(&heap, LEN, 0), Access::REMOTE_WRITE).unwrap();
    let remote = g.remote();
    // SAFETY: the test threads run one at a time (scripts/test); the child uses only its own
    // copies and _exits without unwinding into libtest.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let child = std::panic::AssertUnwindSafe(|| {
            // SAFETY: two bitwise copies of the parent's grant, each used once here; the
            // original is never dropped in the child (it _exits).
            let (revoked, dropped) = unsafe { (std::ptr::read(&g), std::ptr::read(&g)) };
            let code = match revoked.revoke() {
                Err(r) if matches!(r.error, Error::Forked(_)) && r.buf.is_some() => 0,
                _ => 1,
            };
            drop(dropped);
            code
        });
        let code = std::panic::catch_unwind(child).unwrap_or(99);
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: pid is our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
    // The parent's key still works: the child neither deregistered nor invalidated it.
    let src = filled(&heap, LEN, 0x4D);
    a.write(&src, &remote, 0).unwrap();
    let buf = g.revoke().unwrap();
    assert!(buf.iter().all(|&x| x == 0x4D), "written through the parent's key after the child's drops");
    let err = a.write(&src[..64], &RemoteBuf { len: 64, ..remote }, 0).unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "revoked in the parent: {err}");
}

/// A grant's key works through the grantee's connection only: another client of the same
/// server (a third connection, its queue pair in the same PD and admitting remote writes) that
/// learns or guesses the key is refused even inside the granted range, and writes nothing.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_grants_key_works_through_its_connection_only() {
    let (pd, heap) = setup();
    let opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let g = b.grant(filled(&heap, LEN, 0), Access::REMOTE_WRITE | Access::REMOTE_READ).unwrap();
    let remote = g.remote();
    let (c, _d) = Connection::pair(&pd, &opts).unwrap();
    let src = filled(&heap, LEN, 0x66);
    let r = c.write(&src[..64], &RemoteBuf { len: 64, ..remote }, 0);
    println!("WRITE through a grant's key from a third connection: {r:?}");
    let err = r.expect_err("a WRITE through another connection must be refused");
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "third connection: {err}");
    // The grantee reads the buffer untouched, then writes it as usual.
    let mut back = filled(&heap, LEN, 0xFF);
    a.read(&mut back, &remote, 0).unwrap();
    assert!(back.iter().all(|&x| x == 0), "the third connection wrote nothing");
    let mine = filled(&heap, LEN, 0x77);
    a.write(&mine, &remote, 0).unwrap();
    let buf = g.revoke().unwrap();
    assert!(buf.iter().all(|&x| x == 0x77), "the grantee's bytes");
}

#[cfg(feature = "tokio")]
mod lent_third {
    use super::*;
    use mralloc::transfer::{AsyncConnection, RemoteLimits};

    /// Lent memory (requested and pushed): the key works through the borrower's connection
    /// only; another connection of the lender's PD is refused inside the lent range.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run scripts/test"]
    async fn device_lent_memorys_key_works_through_its_connection_only() {
        let (pd, heap) = setup();
        let lender = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::MW_BIND).build().unwrap();
        let opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
        let rw = Access::REMOTE_WRITE | Access::REMOTE_READ;
        let (client, server) = AsyncConnection::pair(&pd, &opts).unwrap();
        server.serve_remote_memory(&lender, RemoteLimits::default()).unwrap();
        let requested = client.request_remote(LEN as u64, rw).await.unwrap();
        server.push(filled(&lender, LEN, 0), rw, 9).await.unwrap();
        let (_, pushed) = client.pushed().await.unwrap();
        for (what, mem) in [("requested", &requested), ("pushed", &pushed)] {
            // A third connection into the lender's PD, fresh each time (a refusal fails it).
            let (third, _lender_side) = AsyncConnection::pair(&pd, &opts).unwrap();
            let r = third.write(filled(&heap, 64, 0x66), &RemoteBuf { len: 64, ..mem.remote() }, 0).await;
            let r = r.map(drop).map_err(|e| e.error);
            println!("WRITE through {what} lent memory's key from a third connection: {r:?}");
            let err = r.expect_err("a WRITE through another connection must be refused");
            assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{what}: {err}");
            let back = client.read(filled(&heap, LEN, 0xFF), &mem.remote(), 0).await.unwrap();
            assert!(back.iter().all(|&x| x == 0), "{what}: the third connection wrote nothing");
            client.write(filled(&heap, LEN, 0x77), &mem.remote(), 0).await.unwrap();
        }
        client.hand_over(requested, 1).unwrap();
        let (_, buf) = server.handed_over().await.unwrap();
        assert!(buf.iter().all(|&x| x == 0x77), "the borrower's bytes");
    }
}

/// A forgotten grant leaks its buffer, but its window does not outlive the connection: the
/// connection deallocates it once its queue pair is flushed, before destroying the queue pair
/// (which on rxe waits 50 s, then warns in the kernel log, for a window still bound to it).
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_forgotten_grant_does_not_hold_up_its_connections_drop() {
    let (pd, heap) = setup();
    let opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let g = b.grant(filled(&heap, LEN, 0), Access::REMOTE_WRITE).unwrap();
    let remote = g.remote();
    std::mem::forget(g);
    a.write(&filled(&heap, 64, 1)[..], &RemoteBuf { len: 64, ..remote }, 0).unwrap();
    let started = Instant::now();
    drop(b);
    let dropped = started.elapsed();
    println!("dropping the grantor's connection with a forgotten grant: {dropped:?}");
    assert!(dropped < std::time::Duration::from_secs(10), "the drop waited {dropped:?}");
}
