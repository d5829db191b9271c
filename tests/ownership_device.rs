//! In-flight memory that safe code cannot break (run in the Soft-RoCE VM by `scripts/test`).
//!
//! Every operation that can outlive its call owns its buffer: forgetting the handle leaks the
//! buffer (the NIC never touches memory a new owner holds), dropping it parks the buffer with the
//! connection until the completion is reaped (without blocking), and buffers move between
//! threads and outlive every `Heap` handle.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mralloc::heap::{draining_heaps, Heap};
use mralloc::transfer::{Connection, IoBuf};
use mralloc::verbs::{Access, Pd};
use mralloc::Buffer;

const OP_TIMEOUT: Duration = Duration::from_secs(20);

fn setup() -> (Pd, Heap, Connection, Connection) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE | Access::MW_BIND).build().unwrap();
    let mut opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
    opts.wait.op_timeout = OP_TIMEOUT;
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    (pd, heap, a, b)
}

/// Reaps completions on `conns` until `done()` holds (at most 10 s).
fn until(conns: &[&Connection], what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        for c in conns {
            c.progress().unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The bytes of a buffer that was leaked (forgotten inside an operation): still mapped.
fn leaked(addr: u64, len: usize) -> Vec<u8> {
    // SAFETY: the buffer at `addr` was moved into a forgotten operation: never freed, and its
    // heap's chunks stay mapped while it (leaked) lives.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
}

/// Shows the heap reuses a freed address at once (so the tests below would see a new owner at
/// a forgotten buffer's address if forgetting freed it).
fn reuse_is_immediate(heap: &Heap, n: usize) {
    let x = heap.alloc(n).unwrap();
    let addr = x.addr();
    drop(x);
    assert_eq!(heap.alloc(n).unwrap().addr(), addr, "the heap hands a freed {n}-byte block out again");
}

fn filled(heap: &Heap, n: usize, byte: u8) -> Buffer {
    let mut b = heap.alloc(n).unwrap();
    b.fill(byte);
    b
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_forgotten_receive_cannot_reach_the_next_owner() {
    // The scenario that broke the safety promise before: a receive posted on a buffer, the
    // handle forgotten, the buffer's memory handed to a new owner, then the peer sends.
    let (_pd, heap, a, b) = setup();
    reuse_is_immediate(&heap, 4096);
    let r = heap.alloc(4096).unwrap();
    let r_addr = r.addr();
    std::mem::forget(b.post_recv(r).unwrap());
    let victim = filled(&heap, 4096, 0x11);
    assert_ne!(victim.addr(), r_addr, "the forgotten buffer's memory was not reused");
    let msg = filled(&heap, 4096, 0xEE);
    a.send(&msg).unwrap();
    until(&[&b], "the SEND lands in the forgotten buffer", || leaked(r_addr, 4096) == vec![0xEE; 4096]);
    assert!(victim.iter().all(|&x| x == 0x11), "no byte of the new owner changed");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_forgotten_sends_writes_and_reads_touch_no_new_owner() {
    let (_pd, heap, a, b) = setup();
    let n = 4096; // a thread-cached size: a freed block is handed out again at once
    reuse_is_immediate(&heap, n);
    let dst = heap.alloc(3 * n).unwrap().expose().unwrap();
    let remote = dst.remote();
    let landed = |range: std::ops::Range<usize>, byte: u8| dst.to_vec()[range].iter().all(|&x| x == byte);

    // WRITE: the NIC reads the forgotten buffer, never a new owner's bytes.
    let src = filled(&heap, n, 0xA1);
    let src_addr = src.addr();
    std::mem::forget(a.post_write(src, &remote, 0).unwrap());
    let victim_w = filled(&heap, n, 0x22);
    assert_ne!(victim_w.addr(), src_addr);
    until(&[&a], "the forgotten WRITE lands", || landed(0..n, 0xA1));

    // WRITE with immediate: same, and the immediate arrives.
    let src = filled(&heap, n, 0xA2);
    std::mem::forget(a.post_write_with_imm(src, &remote, n as u64, 0x5EED).unwrap());
    let _victim_i = filled(&heap, n, 0x33);
    assert_eq!(b.recv_imm().unwrap(), 0x5EED);
    assert!(landed(n..2 * n, 0xA2), "WRITE with immediate carried the forgotten buffer");

    // SEND: the peer receives the forgotten buffer's bytes.
    let inbox = b.post_recv(heap.alloc(n).unwrap()).unwrap();
    let src = filled(&heap, n, 0xA3);
    std::mem::forget(a.post_send(src).unwrap());
    let _victim_s = filled(&heap, n, 0x44);
    let (inbox, got) = inbox.wait().unwrap();
    assert_eq!(got.len, n);
    assert!(inbox.iter().all(|&x| x == 0xA3), "SEND carried the forgotten buffer's bytes");

    // READ: the NIC writes the forgotten buffer, never a new owner.
    let mut source = heap.alloc(n).unwrap();
    source.fill(0xA4);
    let from = source.remote().unwrap();
    let target = heap.alloc(n).unwrap();
    let target_addr = target.addr();
    std::mem::forget(a.post_read(target, &from, 0).unwrap());
    let victim_r = filled(&heap, n, 0x55);
    assert_ne!(victim_r.addr(), target_addr);
    until(&[&a], "the forgotten READ lands", || leaked(target_addr, n) == vec![0xA4; n]);
    assert!(victim_w.iter().all(|&x| x == 0x22), "WRITE's new owner unchanged");
    assert!(victim_r.iter().all(|&x| x == 0x55), "READ's new owner unchanged");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_forgotten_grant_exposes_only_the_leaked_buffer() {
    let (_pd, heap, a, b) = setup();
    reuse_is_immediate(&heap, 8192);
    let granted = heap.alloc(8192).unwrap();
    let granted_addr = granted.addr();
    let g = b.grant(granted, Access::REMOTE_WRITE).unwrap();
    let remote = g.remote();
    std::mem::forget(g);
    let victim = filled(&heap, 8192, 0x66);
    assert_ne!(victim.addr(), granted_addr, "the granted memory was not reused");
    let src = filled(&heap, 8192, 0x77);
    a.write(&src, &remote, 0).unwrap();
    assert_eq!(leaked(granted_addr, 8192), vec![0x77; 8192], "the peer wrote the leaked buffer");
    assert!(victim.iter().all(|&x| x == 0x66), "no byte of the new owner changed");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_dropped_operations_do_not_block_and_free_after_completion() {
    let (_pd, heap, a, b) = setup();
    let base = heap.stats().live_bytes;

    // A posted receive nobody waits for: the drop returns at once; the buffer is freed when a
    // SEND fills it and the completion is reaped.
    let p = b.post_recv(heap.alloc(4096).unwrap()).unwrap();
    let t = Instant::now();
    drop(p);
    let dropped_in = t.elapsed();
    assert!(dropped_in < OP_TIMEOUT / 4, "dropping a posted receive took {dropped_in:?}");
    assert_eq!(heap.stats().live_bytes, base + 4096, "the parked receive buffer is still live");
    let msg = filled(&heap, 100, 0x42);
    a.send(&msg).unwrap();
    until(&[&b], "the parked receive buffer is freed", || heap.stats().live_bytes == base + 100);
    drop(msg);

    // An in-flight 16 MiB write: the drop returns at once, the buffer is freed after the
    // completion, and the data arrived.
    let n = 16 << 20;
    let dst = heap.alloc(n).unwrap().expose().unwrap();
    let before = heap.stats().live_bytes;
    let p = a.post_write(filled(&heap, n, 0x99), &dst.remote(), 0).unwrap();
    let t = Instant::now();
    drop(p);
    assert!(t.elapsed() < OP_TIMEOUT / 4, "dropping an in-flight write took {:?}", t.elapsed());
    until(&[&a], "the parked write buffer is freed", || heap.stats().live_bytes == before);
    let dst = dst.revoke().unwrap();
    assert!(dst.iter().all(|&x| x == 0x99), "the dropped write completed");

    // A write that is certainly still in flight when dropped: it queues behind a SEND the peer
    // has no receive for (RNR retries for ever; one queue executes in order). Both buffers stay
    // live and their addresses are not handed out again until the peer posts a receive.
    let dst = dst.expose().unwrap();
    let (s, w) = (filled(&heap, 4096, 0x11), filled(&heap, n, 0x77));
    let (blocker_at, held_at) = (s.addr(), w.addr());
    let blocker = a.post_send(s).unwrap();
    let held = a.post_write(w, &dst.remote(), 0).unwrap();
    drop((blocker, held));
    std::thread::sleep(Duration::from_millis(200));
    a.progress().unwrap();
    assert_eq!(heap.stats().live_bytes, before + 4096 + n as u64, "the held SEND's and WRITE's buffers are live");
    let (x, y) = (heap.alloc(4096).unwrap(), heap.alloc(n).unwrap());
    assert!(x.addr() != blocker_at && y.addr() != held_at, "a held buffer's address was handed out again");
    drop((x, y));
    assert!(dst.to_vec().iter().all(|&x| x == 0x99), "the write behind the held SEND has not run");
    let inbox = b.post_recv(heap.alloc(4096).unwrap()).unwrap();
    let (inbox, got) = inbox.wait().unwrap();
    assert_eq!((got.len, inbox[0]), (4096, 0x11));
    drop(inbox);
    until(&[&a], "the held SEND's and WRITE's buffers are freed", || heap.stats().live_bytes == before);
    let dst = dst.revoke().unwrap();
    assert!(dst.iter().all(|&x| x == 0x77), "the dropped write behind the SEND completed");

    // Closing a connection with a parked receive frees it (flushed).
    let p = b.post_recv(heap.alloc(8192).unwrap()).unwrap();
    drop(p);
    assert_eq!(heap.stats().live_bytes, before + 8192);
    b.close().unwrap();
    assert_eq!(heap.stats().live_bytes, before, "close() flushed and freed the parked receive");
    assert!(matches!(b.send(&dst[..8]), Err(mralloc::Error::Closed)), "a closed connection refuses posts");

    // Dropping a connection frees what it still holds.
    let p = a.post_recv(heap.alloc(8192).unwrap()).unwrap();
    drop(p);
    drop(a);
    assert_eq!(heap.stats().live_bytes, before, "dropping the connection freed the parked receive");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_buffers_cross_threads_and_outlive_their_heap_handles() {
    let (_pd, heap, a, b) = setup();
    let n = 1 << 20;
    let dst = heap.alloc(n).unwrap().expose().unwrap();
    let remote = dst.remote();
    let base = heap.stats().live_bytes;

    // Allocated on one thread, posted from a second, freed on a third.
    let made = std::thread::spawn({
        let heap = heap.clone();
        move || {
            let mut b = heap.alloc(n).unwrap();
            b.copy_from_slice(&pattern(9, n));
            b
        }
    })
    .join()
    .unwrap();
    let done =
        std::thread::scope(|s| s.spawn(|| a.post_write(made, &remote, 0).unwrap().wait().unwrap().0).join()).unwrap();
    std::thread::spawn(move || drop(done)).join().unwrap();
    assert_bytes_eq(&dst.to_vec(), &pattern(9, n), "written from the second thread");
    assert_eq!(heap.stats().live_bytes, base, "freed on the third thread");

    // A sub-range through an owned slice, and the whole buffer back.
    let buf = filled(&heap, 8192, 0x10);
    let p = a.post_write(buf.into_slice(4096..6144).unwrap(), &remote, 0).unwrap();
    let (slice, _) = p.wait().unwrap();
    assert_eq!((slice.begin(), slice.end(), slice.len()), (4096, 6144, 2048));
    assert_eq!(slice.into_inner().len(), 8192);

    // Every handle dropped while a buffer (parked in a receive) lives: the heap stays
    // registered, the receive still lands, and the heap is torn down after the buffer goes.
    let inbox = heap.alloc(4096).unwrap();
    let inbox_addr = inbox.addr();
    drop(b.post_recv(inbox).unwrap());
    let src = filled(&heap, 4096, 0xC3);
    let draining = draining_heaps(); // heaps of other tests with leaked (forgotten) buffers
    drop((heap, dst));
    assert_eq!(draining_heaps(), draining + 1, "the heap waits for its live buffers");
    assert!(mralloc::heap::chunk_of(inbox_addr as *const u8).is_some(), "its chunks are still mapped");
    a.send(&src).unwrap();
    drop(src);
    until(&[&b], "the parked buffer is freed and the heap torn down", || {
        mralloc::heap::chunk_of(inbox_addr as *const u8).is_none()
    });
    until(&[], "the heap left the draining list", || draining_heaps() == draining);
}
