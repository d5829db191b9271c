//! Registration on first use (`HeapBuilder::register_on_first_use`) against a real device
//! (Soft-RoCE in the VM; run by `scripts/test`): a heap bound to two PDs of one device — two
//! distinct protection domains — registers its chunks with the second one only when memory of
//! them is used through it, once per chunk however many threads race, and every such
//! registration is gone after idle release and the heap's drop (the kernel's resource tracker
//! counts them).

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::*;
use mralloc::heap::{chunk_of, Buffer, Heap, HeapStats};
use mralloc::keys_of_for;
use mralloc::transfer::Connection;
use mralloc::verbs::{Access, Pd};

const MIB: usize = 1 << 20;

/// The memory regions in this process's PDs, as the kernel counts them.
fn mrs() -> usize {
    resources("mr", &our_pdns())
}

/// Data chunks of `st`. jemalloc's metadata blocks (never registered) are counted as 2 MiB each:
/// true of these small heaps, whose arena's metadata fits its first block (a second one would be
/// larger, and this count then too small: the assertions using it fail, they cannot pass
/// falsely).
fn data_chunks(st: &HeapStats) -> u64 {
    st.chunks - st.metadata_bytes.div_ceil(2 * MIB as u64)
}

fn two_pd_heap(pd1: &Pd, pd2: &Pd, first_use: bool, idle: Option<Duration>) -> Heap {
    Heap::builder()
        .bind(pd1)
        .bind(pd2)
        .max_chunk(4 * MIB)
        .thread_cache(0)
        .idle_release(idle)
        .register_on_first_use(first_use)
        .build()
        .unwrap()
}

/// 3 MiB buffers (one per 4 MiB chunk) until the heap holds `n` data chunks.
fn fill_chunks(heap: &Heap, n: usize) -> Vec<Buffer> {
    let mut bufs: Vec<Buffer> = Vec::new();
    while bufs.iter().filter_map(|b| chunk_of(b.as_ptr())).collect::<std::collections::HashSet<_>>().len() < n {
        let mut b = heap.alloc(3 * MIB).unwrap();
        b.fill(bufs.len() as u8);
        bufs.push(b);
    }
    bufs
}

/// Memory on `pd2` a connection of `pd2` can WRITE into.
fn target(pd2: &Pd, len: usize) -> (Heap, mralloc::heap::Exposed) {
    let heap = Heap::builder().bind(pd2).access(Access::ALL_REMOTE).build().unwrap();
    let dst = heap.alloc(len).unwrap().expose().unwrap();
    (heap, dst)
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_first_use_registers_a_chunk_with_the_second_pd_once_when_used() {
    let ctx = open();
    let (pd1, pd2) = (Pd::new(&ctx).unwrap(), Pd::new(&ctx).unwrap());
    const N: usize = 6;
    // Eager: every chunk in both PDs.
    let base = mrs();
    let eager = two_pd_heap(&pd1, &pd2, false, None);
    let bufs = fill_chunks(&eager, N);
    let st = eager.stats();
    assert!(st.metadata_bytes > 0);
    assert_eq!(st.registered_bytes[0], st.mapped_bytes - st.metadata_bytes, "every data chunk, no metadata");
    assert_eq!(st.registered_bytes[1], st.registered_bytes[0], "eager: every data chunk in pd2 too");
    assert_eq!(mrs() - base, 2 * data_chunks(&st) as usize);
    drop((bufs, eager));
    assert_eq!(mrs(), base, "the eager heap's drop left registrations");

    // On first use: only the primary PD until used.
    let heap = two_pd_heap(&pd1, &pd2, true, None);
    let bufs = fill_chunks(&heap, N);
    let st = heap.stats();
    println!("first use, before: {st:?}");
    assert_eq!(st.registered_bytes[0], st.mapped_bytes - st.metadata_bytes);
    assert_eq!((st.registered_bytes[1], st.first_use_registrations), (0, 0), "nothing in pd2 before use");
    assert_eq!(mrs() - base, data_chunks(&st) as usize);
    assert_eq!(st.reg_mr_calls, data_chunks(&st));

    let (target_heap, dst) = target(&pd2, 64 << 10);
    let (a, _b) = Connection::pair(&pd2, &rights(Access::REMOTE_WRITE)).unwrap();
    let before = mrs();
    a.write(&bufs[3][100..100 + (64 << 10)], &dst.remote(), 0).unwrap();
    assert!(dst.to_vec().iter().all(|&x| x == 3), "the bytes arrived");
    let used = heap.stats();
    let len3 = chunk_of(bufs[3].as_ptr()).unwrap().1 as u64;
    assert_eq!(mrs(), before + 1, "the first use made one registration");
    assert_eq!(used.registered_bytes[1], len3, "exactly the used chunk");
    assert_eq!((used.first_use_registrations, used.reg_mr_calls), (1, st.reg_mr_calls + 1));
    // Used again (another range of the same chunk, then the same): no new registration.
    a.write(&bufs[3][..4096], &dst.remote(), 0).unwrap();
    a.write(&bufs[3][100..100 + (64 << 10)], &dst.remote(), 0).unwrap();
    assert_eq!(mrs(), before + 1, "a second use registered again");
    assert_eq!(heap.stats().first_use_registrations, 1);
    let k = keys_of_for(bufs[3].as_ptr(), &pd2).expect("keys in pd2 now");
    assert_eq!(Some(k), bufs[3].keys_for(&pd2));
    // Another chunk, through a key lookup for pd2: that one only.
    assert!(bufs[5].keys_for(&pd2).is_some());
    let len5 = chunk_of(bufs[5].as_ptr()).unwrap().1 as u64;
    assert_eq!(heap.stats().registered_bytes[1], len3 + len5);
    assert_eq!(mrs(), before + 2);
    drop((a, _b, dst, target_heap));
    drop((bufs, heap));
    assert_eq!(mrs(), base, "the heap's drop left registrations");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_threads_racing_a_first_use_make_one_registration() {
    let ctx = open();
    let (pd1, pd2) = (Pd::new(&ctx).unwrap(), Pd::new(&ctx).unwrap());
    let base = mrs();
    let heap = two_pd_heap(&pd1, &pd2, true, None);
    const N: usize = 4;
    const THREADS: usize = 4;
    let bufs = fill_chunks(&heap, N);
    let before = mrs();
    let start = Barrier::new(THREADS);
    let keys: Vec<Vec<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    bufs.iter().map(|b| keys_of_for(b.as_ptr(), &pd2).expect("keys in pd2").lkey).collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let chunks: std::collections::HashSet<_> = bufs.iter().filter_map(|b| chunk_of(b.as_ptr())).collect();
    let st = heap.stats();
    println!("after the race: {st:?}");
    assert!(keys.iter().all(|k| *k == keys[0]), "the threads got different keys: {keys:?}");
    assert_eq!(st.first_use_registrations, chunks.len() as u64, "one registration per chunk");
    assert_eq!(mrs() - before, chunks.len(), "the kernel holds one MR per chunk in pd2");
    assert_eq!(st.registered_bytes[1], chunks.iter().map(|c| c.1 as u64).sum::<u64>());
    drop((bufs, heap));
    assert_eq!(mrs(), base, "the heap's drop left registrations");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_idle_release_deregisters_first_use_registrations() {
    let ctx = open();
    let (pd1, pd2) = (Pd::new(&ctx).unwrap(), Pd::new(&ctx).unwrap());
    let base = mrs();
    let heap = two_pd_heap(&pd1, &pd2, true, Some(Duration::from_secs(1)));
    let live = heap.alloc(64 << 10).unwrap();
    let burst = fill_chunks(&heap, 6);
    for b in burst.iter().chain([&live]) {
        assert!(b.keys_for(&pd2).is_some(), "registered on first use");
    }
    let busy = heap.stats();
    assert_eq!(busy.registered_bytes[1], busy.registered_bytes[0], "every data chunk used");
    let live_chunk = chunk_of(live.as_ptr()).unwrap();
    let busy_mrs = mrs();
    drop(burst);
    heap.decay().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    heap.decay().unwrap();
    let idle = heap.stats();
    println!("busy {busy:?}\nidle {idle:?}");
    assert!(idle.idle_chunks > 0, "nothing was released");
    assert_eq!(idle.registered_bytes[0] + idle.idle_bytes + idle.metadata_bytes, idle.mapped_bytes);
    assert_eq!(
        idle.registered_bytes[1] + idle.idle_bytes,
        busy.registered_bytes[1],
        "pd2's registrations of the idle chunks are gone"
    );
    assert_eq!(busy_mrs - mrs(), 2 * idle.idle_chunks as usize, "both MRs of each idle chunk deregistered");
    assert!(live.keys_for(&pd2).is_some() && idle.registered_bytes[1] >= live_chunk.1 as u64);
    // Used again: the primary registers at commit, pd2 on the next use through it.
    let again = heap.alloc(3 * MIB).unwrap();
    let st = heap.stats();
    assert_eq!(st.registered_bytes[1], idle.registered_bytes[1], "pd2 waits for a use");
    assert!(again.keys_for(&pd2).is_some());
    assert!(heap.stats().registered_bytes[1] > idle.registered_bytes[1]);
    drop((again, live, heap));
    assert_eq!(mrs(), base, "the heap's drop left registrations");
}

/// The cost both ways (printed; run with --nocapture): map + register `CHUNKS` 2 MiB chunks
/// with two PDs, eager vs on first use, and the first use of a chunk through the second PD (a
/// key lookup that registers it) vs a later lookup. Asserts only what the mode promises.
///
/// One line per round and mode (`FIRST_USE_ROUNDS` rounds, default 3), read by
/// scripts/bench-transfer — anywhere in a line: with --nocapture libtest's `test ... ` may
/// precede the first one:
///
/// `FIRST_USE round=<r> mode=<eager|first_use> chunks=<data chunks> buffers=<n>
/// reg_mr_calls=<n> map_register_ms=<all chunks mapped and registered> in_reg_mr_ms=<of which in
/// ibv_reg_mr> first_use_us_median=<…> first_use_us_min=<…> first_use_us_max=<…>
/// later_lookup_us_median=<…>` (the first-use fields `-` for eager).
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_first_use_cost() {
    const CHUNKS: usize = 64;
    let rounds: usize = std::env::var("FIRST_USE_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let ctx = open();
    let (pd1, pd2) = (Pd::new(&ctx).unwrap(), Pd::new(&ctx).unwrap());
    let build = |first_use| {
        Heap::builder()
            .bind(&pd1)
            .bind(&pd2)
            .max_chunk(2 * MIB)
            .thread_cache(0)
            .idle_release(None)
            .register_on_first_use(first_use)
            .build()
            .unwrap()
    };
    for round in 0..rounds {
        for first_use in [false, true] {
            let heap = build(first_use);
            let t = Instant::now();
            let mut bufs = Vec::new();
            while data_chunks(&heap.stats()) < CHUNKS as u64 {
                bufs.push(heap.alloc(MIB + MIB / 2).unwrap());
            }
            let fill = t.elapsed();
            let st = heap.stats();
            let mut first = Vec::new();
            let mut later = Vec::new();
            if first_use {
                for b in &bufs {
                    let t = Instant::now();
                    assert!(b.keys_for(&pd2).is_some());
                    first.push(t.elapsed());
                    let t = Instant::now();
                    assert!(b.keys_for(&pd2).is_some());
                    later.push(t.elapsed());
                }
            }
            first.sort();
            later.sort();
            let med = |v: &[Duration]| v.get(v.len() / 2).copied();
            let us = |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{:.2}", d.as_secs_f64() * 1e6));
            if round == 0 && !first_use {
                println!(); // off libtest's `test ... ` line
            }
            println!(
                "FIRST_USE round={round} mode={} chunks={} buffers={} reg_mr_calls={} map_register_ms={:.3} \
                 in_reg_mr_ms={:.3} first_use_us_median={} first_use_us_min={} first_use_us_max={} \
                 later_lookup_us_median={}",
                if first_use { "first_use" } else { "eager" },
                data_chunks(&st),
                bufs.len(),
                st.reg_mr_calls,
                fill.as_secs_f64() * 1e3,
                st.reg_mr_time.as_secs_f64() * 1e3,
                us(med(&first)),
                us(first.first().copied()),
                us(first.last().copied()),
                us(med(&later)),
            );
            if first_use {
                let used: std::collections::HashSet<_> = bufs.iter().filter_map(|b| chunk_of(b.as_ptr())).collect();
                assert_eq!(heap.stats().first_use_registrations, used.len() as u64);
            }
        }
    }
}
