//! Idle release on a bound heap (Soft-RoCE in the VM; run by `scripts/test`): after a burst and
//! the interval the burst's chunks are deregistered (registered bytes fall by what went idle),
//! a chunk with a live buffer keeps its registration, and memory used again is registered again
//! and moves correctly over RDMA — and when the kernel refuses that registration again, nothing
//! unregistered is handed out and no chunk is lost.

mod common;

use std::time::Duration;

use common::*;
use mralloc::heap::{chunk_of, Buffer, Exposed, Heap, HeapStats};
use mralloc::verbs::{Access, Pd, SendOp, SendWr};
use mralloc::Error;

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
    assert_eq!(
        idle.registered_bytes[0] + idle.idle_bytes + idle.metadata_bytes,
        idle.mapped_bytes,
        "registered bytes are true"
    );
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
    assert_eq!(used.registered_bytes[0] + used.idle_bytes + used.metadata_bytes, used.mapped_bytes);
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

/// RDMA-WRITEs `buf` (filled with `pattern(seed)`) into `dst`, zeroes it, and RDMA-READs `dst`
/// back into it: `buf`'s chunk keys work both ways (the NIC reads and writes its pages). `dst`
/// was exposed beforehand: this makes no registration.
fn through(lb: &Loopback, buf: &mut Buffer, dst: &Exposed, seed: u64, what: &str) {
    let n = buf.len();
    let want = pattern(seed, n);
    buf.copy_from_slice(&want);
    let remote = dst.remote().at(0, n as u64).unwrap();
    let sge = [buf.sge(..).expect("sge")];
    // SAFETY: `buf` and `dst` outlive the completion polled right after the post; the CPU does
    // not touch them meanwhile.
    unsafe { lb.a.post_send(&[SendWr::new(1, &sge, SendOp::Write(remote))]).unwrap() };
    lb.cq_a.next(WAIT).unwrap().ok().unwrap_or_else(|e| panic!("{what}: write: {e}"));
    assert_bytes_eq(&dst.to_vec()[..n], &want, &format!("{what}: RDMA WRITE"));
    buf.fill(0);
    let sge = [buf.sge(..).expect("sge")];
    // SAFETY: as above.
    unsafe { lb.a.post_send(&[SendWr::new(2, &sge, SendOp::Read(remote))]).unwrap() };
    lb.cq_a.next(WAIT).unwrap().ok().unwrap_or_else(|e| panic!("{what}: read: {e}"));
    assert_bytes_eq(buf, &want, &format!("{what}: RDMA READ"));
}

/// Registered bytes are exactly the data chunks that are not idle (metadata is never
/// registered), in each of the first `pds` PDs.
fn registered_are_true_in(st: &HeapStats, pds: usize, what: &str) {
    for slot in 0..pds {
        assert_eq!(
            st.registered_bytes[slot] + st.idle_bytes + st.metadata_bytes,
            st.mapped_bytes,
            "{what}: registered bytes (PD {slot}) are not true: {st:?}"
        );
    }
}

fn registered_are_true(st: &HeapStats, what: &str) {
    registered_are_true_in(st, 1, what);
}

/// A bound heap that releases chunks after 500 ms, without a thread cache.
fn idle_heap(pds: &[&Pd], max_chunk: usize) -> Heap {
    let b = pds.iter().fold(Heap::builder(), |b, pd| b.bind(pd));
    b.max_chunk(max_chunk).thread_cache(0).idle_release(Some(Duration::from_millis(500))).build().unwrap()
}

/// A burst of `n` 1 MiB buffers, freed; returns their chunks once every data chunk is idle.
fn burst_then_idle(heap: &Heap, n: usize) -> std::collections::HashSet<(usize, usize)> {
    let burst: Vec<Buffer> = (0..n)
        .map(|_| {
            let mut b = heap.alloc(MIB).unwrap();
            b.fill(0xA5);
            b
        })
        .collect();
    let chunks = burst.iter().map(|b| chunk_of(b.as_ptr()).unwrap()).collect();
    println!("busy {:?}", heap.stats());
    drop(burst);
    // Every data chunk idle: jemalloc has nothing committed left but its metadata.
    wait_for("every data chunk released", Duration::from_secs(60), || {
        heap.decay().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let st = heap.stats();
        st.idle_bytes + st.metadata_bytes == st.mapped_bytes
    });
    chunks
}

/// The real chain when an idle chunk's registration is refused (issue 35): the kernel refuses to
/// pin more than `RLIMIT_MEMLOCK` (the VM's root loses `CAP_IPC_LOCK` for it, in a child
/// process), so the commit hook cannot register the idle chunk jemalloc carves from and fails
/// the commit. What the docs promise (`heap::idle`): jemalloc falls back on a new chunk, and the
/// allocation fails with `Error::Registration` only if that fails too. Checked: with no room at
/// all the allocation is that error and nothing changed (no chunk mapped, none lost, the idle
/// ones still idle); with room for an exact-size chunk but not for an idle one, the allocation
/// is served from a new registered chunk whose keys carry RDMA both ways, the idle chunks
/// untouched; with the limit restored, the burst is served from the idle chunks again (no new
/// chunk: none was lost), registered again, and moves over RDMA.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_an_idle_chunk_whose_registration_is_refused_is_never_handed_out() {
    const NAME: &str = "device_an_idle_chunk_whose_registration_is_refused_is_never_handed_out";
    if std::env::var("MRALLOC_IDLE_REFUSED_CHILD").is_err() {
        run_in_child(NAME, "MRALLOC_IDLE_REFUSED_CHILD", &[], "idle refused");
        return;
    }
    drop_ipc_lock(); // before the device is opened (see tests/common/memlock.rs)
    let saved = memlock();
    let lb = loopback();
    // The far side: exposed (registered) before any limit, never idle.
    let far = Heap::builder().bind(&lb.pd).access(Access::ALL_REMOTE).idle_release(None).build().unwrap();
    let dst = far.alloc(MIB).unwrap().expose().unwrap();
    let heap = idle_heap(&[&lb.pd], 8 * MIB);
    let burst_chunks = burst_then_idle(&heap, 24);
    let smallest = burst_chunks.iter().map(|c| c.1).min().unwrap();
    let idle = heap.stats();
    println!("idle {idle:?}\nburst chunks {burst_chunks:?}");
    assert_eq!(idle.idle_chunks as usize, burst_chunks.len());
    registered_are_true(&idle, "idle");

    // No room at all: the idle chunk's commit and every new chunk are refused.
    set_memlock_soft(vm_pinned_kib() << 10);
    match heap.alloc(MIB) {
        Err(Error::Registration { errno, hint }) => {
            println!("no room: errno {errno}; {hint}");
            assert_eq!(errno, libc::ENOMEM, "{hint}");
            assert!(hint.contains("RLIMIT_MEMLOCK"), "{hint}");
        }
        other => panic!("expected Error::Registration with no memlock room, got {other:?}"),
    }
    let refused = heap.stats();
    println!("refused {refused:?}");
    assert_eq!(
        (refused.chunks, refused.mapped_bytes, refused.idle_chunks, refused.reg_mr_calls),
        (idle.chunks, idle.mapped_bytes, idle.idle_chunks, idle.reg_mr_calls),
        "a refused allocation changed the heap"
    );
    registered_are_true(&refused, "refused");
    // Refused: the idle chunk's commit, then jemalloc's growth by a new chunk, then its
    // exact-size retry (the heap tries the allocation twice: 6 in all).
    assert!(refused.registration_failures >= idle.registration_failures + 3, "{refused:?}");

    // Room for a chunk of the request's size, not for an idle (or a grown) one.
    // (jemalloc's exact-size retry maps 1 MiB and a page; the smallest idle chunk is 2 MiB)
    let room = MIB + MIB / 2;
    assert!(smallest > room, "the idle chunks ({smallest} bytes) fit in the room given");
    set_memlock_soft((vm_pinned_kib() << 10) + room as u64);
    let mut served = heap.alloc(MIB).expect("jemalloc falls back on a chunk that fits");
    let fell_back = heap.stats();
    println!("fell back {fell_back:?}");
    let chunk = chunk_of(served.as_ptr()).unwrap();
    assert!(!burst_chunks.contains(&chunk), "served from an idle chunk whose registration was refused");
    assert!(chunk.1 <= room, "not a chunk of the room's size: {chunk:?}");
    assert!(served.keys().is_some(), "no keys for memory handed out");
    assert_eq!(fell_back.idle_chunks, refused.idle_chunks, "an idle chunk left its state");
    assert_eq!((fell_back.chunks, fell_back.reg_mr_calls), (refused.chunks + 1, refused.reg_mr_calls + 1));
    // Refused before the exact-size chunk: the idle chunk's commit (without it, only the growth
    // would have been tried: 1) and the growth.
    assert!(fell_back.registration_failures >= refused.registration_failures + 2, "{fell_back:?}");
    registered_are_true(&fell_back, "fell back");
    through(&lb, &mut served, &dst, 7, "served under the limit");

    // The limit restored: the burst fits in the idle chunks again, registered again.
    set_memlock_soft(saved.rlim_cur);
    let mut again: Vec<Buffer> = (0..24)
        .map(|_| {
            let b = heap.alloc(MIB).unwrap();
            assert!(b.iter().all(|&x| x == 0), "reused memory is not zero");
            b
        })
        .collect();
    let used = heap.stats();
    println!("used again {used:?}");
    assert_eq!(used.chunks, fell_back.chunks, "a new chunk mapped: an idle one was lost");
    assert!(used.idle_chunks < fell_back.idle_chunks, "no idle chunk was used again");
    // Each idle chunk used again was registered again, once.
    assert_eq!(used.reg_mr_calls - fell_back.reg_mr_calls, fell_back.idle_chunks - used.idle_chunks);
    registered_are_true(&used, "used again");
    for (i, b) in again.iter_mut().enumerate() {
        assert!(burst_chunks.contains(&chunk_of(b.as_ptr()).unwrap()));
        through(&lb, b, &dst, 100 + i as u64, &format!("reused #{i}"));
    }
    println!("idle refused child: OK");
}

/// Two PDs, and the refusal comes at the second PD's registration of an idle chunk, after the
/// first PD's succeeded: the commit hook must take that one back (`withdraw`) — else the chunk
/// stays registered and pinned in one PD while jemalloc keeps it decommitted, and its next
/// commit registers it once more. Every chunk is 2 MiB (`max_chunk`); the room (3 MiB) fits one
/// PD's registration of one, not both, and fits the exact-size chunk of a 1 MiB request in both
/// (1 MiB and a page, twice). Checked against the kernel: its MRs in our PDs and our pinned
/// pages grow by exactly the served chunk's two registrations.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_second_pd_refusing_an_idle_chunk_takes_the_first_registration_back() {
    const NAME: &str = "device_a_second_pd_refusing_an_idle_chunk_takes_the_first_registration_back";
    if std::env::var("MRALLOC_IDLE_WITHDRAW_CHILD").is_err() {
        run_in_child(NAME, "MRALLOC_IDLE_WITHDRAW_CHILD", &[], "idle withdraw");
        return;
    }
    drop_ipc_lock(); // before the device is opened (see tests/common/memlock.rs)
    let saved = memlock();
    let lb = loopback();
    let pd2 = Pd::new(&lb.ctx).unwrap();
    let far = Heap::builder().bind(&lb.pd).access(Access::ALL_REMOTE).idle_release(None).build().unwrap();
    let dst = far.alloc(MIB).unwrap().expose().unwrap();
    let heap = idle_heap(&[&lb.pd, &pd2], 2 * MIB);
    let burst_chunks = burst_then_idle(&heap, 12);
    let idle = heap.stats();
    println!("idle {idle:?}");
    assert!(burst_chunks.iter().all(|c| c.1 == 2 * MIB), "{burst_chunks:?}");
    assert_eq!(idle.idle_chunks as usize, burst_chunks.len());
    registered_are_true_in(&idle, 2, "idle");

    let pdns = our_pdns();
    let (mrs, pinned) = (resources("mr", &pdns), vm_pinned_kib());
    set_memlock_soft((pinned << 10) + 3 * MIB as u64);
    let mut served = heap.alloc(MIB).expect("jemalloc falls back on a chunk that fits");
    let st = heap.stats();
    let chunk = chunk_of(served.as_ptr()).unwrap();
    println!("fell back {st:?}\nchunk {chunk:?}");
    assert!(!burst_chunks.contains(&chunk) && chunk.1 < 2 * MIB, "served from a refused chunk: {chunk:?}");
    assert!(served.keys().is_some() && served.keys_for(&pd2).is_some(), "not registered in both PDs");
    assert_eq!(st.idle_chunks, idle.idle_chunks, "an idle chunk left its state");
    registered_are_true_in(&st, 2, "fell back");
    // Refused: the idle chunk's second registration, then the growth's (a 2 MiB chunk).
    assert!(st.registration_failures >= idle.registration_failures + 2, "{st:?}");
    // The kernel holds the served chunk's two registrations and nothing else new: the first
    // PD's registrations of the refused idle chunk and of the refused growth were taken back.
    assert_eq!(resources("mr", &pdns), mrs + 2, "registrations of refused chunks left in the kernel");
    assert_eq!(vm_pinned_kib(), pinned + 2 * (chunk.1 as u64 >> 10), "pages of refused chunks left pinned");
    through(&lb, &mut served, &dst, 9, "served under the limit");

    // The limit restored: the idle chunks serve again, registered once in each PD.
    set_memlock_soft(saved.rlim_cur);
    let mut again: Vec<Buffer> = (0..burst_chunks.len()).map(|_| heap.alloc(MIB).unwrap()).collect();
    let used = heap.stats();
    println!("used again {used:?}");
    assert_eq!((used.chunks, used.idle_chunks), (st.chunks, 0), "an idle chunk was lost");
    assert_eq!(used.reg_mr_calls - st.reg_mr_calls, 2 * idle.idle_chunks);
    assert_eq!(resources("mr", &pdns), mrs + 2 + 2 * burst_chunks.len());
    registered_are_true_in(&used, 2, "used again");
    for (i, b) in again.iter_mut().enumerate() {
        assert!(burst_chunks.contains(&chunk_of(b.as_ptr()).unwrap()));
        assert!(b.keys_for(&pd2).is_some());
        through(&lb, b, &dst, 200 + i as u64, &format!("reused #{i}"));
    }
    println!("idle withdraw child: OK");
}
