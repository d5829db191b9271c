//! Idle release on a bound heap (Soft-RoCE in the VM; run by `scripts/test`): after a burst and
//! the interval the burst's chunks are deregistered (registered bytes fall by what went idle),
//! a chunk with a live buffer keeps its registration, and memory used again is registered again
//! and moves correctly over RDMA.

mod common;

use std::time::Duration;

use common::*;
use mralloc::heap::{chunk_of, Buffer, Heap};
use mralloc::verbs::Access;

const MIB: usize = 1 << 20;

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_idle_chunks_are_deregistered_and_registered_again_on_use() {
    let lb = loopback();
    let heap = Heap::builder()
        .bind(&lb.pd)
        .access(Access::ALL_REMOTE)
        .max_chunk(8 * MIB)
        .thread_cache(0)
        .idle_release(Some(Duration::from_secs(2)))
        .build()
        .unwrap();
    // A live buffer first, then a burst that shares its chunk and fills more.
    let live = {
        let mut b = heap.alloc(64 << 10).unwrap();
        b.copy_from_slice(&pattern(1, 64 << 10));
        b
    };
    let live_chunk = chunk_of(live.as_ptr()).unwrap();
    let live_keys = heap.keys(live.as_ptr()).expect("registered");
    // Written: the freed blocks of the live buffer's chunk keep these bytes (registered pages
    // are never dropped), so memory committed again must be zeroed by the hook.
    let burst: Vec<Buffer> = (0..24)
        .map(|_| {
            let mut b = heap.alloc(MIB).unwrap();
            b.fill(0xA5);
            b
        })
        .collect();
    let busy = heap.stats();
    assert_eq!(busy.idle_chunks, 0);
    drop(burst);
    // jemalloc's decay takes the frees in at its next run and releases an interval later.
    heap.decay().unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    heap.decay().unwrap();
    let idle = heap.stats();
    println!("busy {busy:?}\nidle {idle:?}");
    assert!(idle.idle_chunks > 0, "nothing was released");
    assert_eq!(idle.registered_bytes[0] + idle.idle_bytes, idle.mapped_bytes, "registered bytes are true");
    assert!(idle.registered_bytes[0] < busy.registered_bytes[0], "registered bytes did not fall");
    // The live buffer's chunk stays registered, with the same keys, and its bytes move.
    assert_eq!(chunk_of(live.as_ptr()), Some(live_chunk));
    assert_eq!(heap.keys(live.as_ptr()), Some(live_keys), "the live buffer's chunk was released");
    let dst = heap.alloc(64 << 10).unwrap();
    let back = heap.alloc(64 << 10).unwrap();
    assert!(dst.iter().chain(back.iter()).all(|&x| x == 0), "reused memory is not zero");
    write_read(&lb, &live, dst, &back, "the live buffer");
    // Used again — the live buffer's chunk's freed (decommitted, not dropped) memory among it,
    // zeroed when committed again: registered again (new registrations), correct over RDMA.
    let calls = heap.stats().reg_mr_calls;
    let again: Vec<Buffer> = (0..24)
        .map(|i| {
            let mut b = heap.alloc(MIB).unwrap();
            assert!(b.iter().all(|&x| x == 0), "reused memory is not zero");
            b.copy_from_slice(&pattern(10 + i, MIB));
            b
        })
        .collect();
    let used = heap.stats();
    println!("used again {used:?}");
    assert!(used.reg_mr_calls > calls, "no chunk was registered again");
    assert!(used.idle_chunks < idle.idle_chunks);
    assert_eq!(used.registered_bytes[0] + used.idle_bytes, used.mapped_bytes);
    for (i, src) in again.iter().enumerate().step_by(5) {
        assert!(heap.keys(src.as_ptr()).is_some(), "no keys for memory handed out");
        let dst = heap.alloc(MIB).unwrap();
        let back = heap.alloc(MIB).unwrap();
        write_read(&lb, src, dst, &back, &format!("reused #{i}"));
    }
}

/// A released chunk whose pages the kernel would not drop — the application mlock()ed a buffer
/// in it, and the lock outlives the free — keeps its old bytes: the next use zeroes them, so a
/// heap allocation (zeroed) never shows another buffer's bytes. (Found by review: the release
/// took every chunk for zero after `MADV_DONTNEED`, which fails on locked ranges.)
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_released_chunk_whose_pages_stay_is_zeroed_before_reuse() {
    let lb = loopback();
    let heap = Heap::builder()
        .bind(&lb.pd)
        .max_chunk(8 * MIB)
        .thread_cache(0)
        .idle_release(Some(Duration::from_millis(500)))
        .build()
        .unwrap();
    let burst: Vec<Buffer> = (0..24)
        .map(|_| {
            let mut b = heap.alloc(MIB).unwrap();
            b.fill(0xA5);
            // SAFETY: locks this buffer's own mapped pages (no memory is touched).
            assert_eq!(unsafe { libc::mlock(b.as_ptr().cast(), b.len()) }, 0, "mlock");
            b
        })
        .collect();
    drop(burst);
    heap.decay().unwrap();
    std::thread::sleep(Duration::from_millis(900));
    heap.decay().unwrap();
    assert!(heap.stats().idle_chunks > 0, "nothing released: {:?}", heap.stats());
    let again: Vec<Buffer> = (0..24).map(|_| heap.alloc(MIB).unwrap()).collect();
    let stale: usize = again.iter().map(|b| b.iter().filter(|&&x| x != 0).count()).sum();
    assert_eq!(stale, 0, "{stale} bytes of freed buffers handed out in new (zeroed) ones");
}
