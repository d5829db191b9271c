//! Idle release on an unbound heap (the same hooks and chunk records as a bound one, without
//! `ibv_reg_mr`): after a burst and the idle interval, the burst's chunks are idle and their
//! pages gone; nothing is released with the interval off, from `reserve`d chunks, or under a
//! live buffer. (tests/heap_device.rs checks the registrations of a bound heap.)

use std::time::Duration;

use mralloc::heap::{chunk_of, Buffer, Heap};

const MIB: usize = 1 << 20;

/// Resident pages of `[base, base+len)`.
fn resident(base: usize, len: usize) -> usize {
    let mut v = vec![0u8; len.div_ceil(4096)];
    // SAFETY: mincore only inspects page tables; `v` has one byte per page of the range.
    assert_eq!(unsafe { libc::mincore(base as *mut libc::c_void, len, v.as_mut_ptr()) }, 0);
    v.iter().filter(|&&b| b & 1 != 0).count()
}

/// The distinct chunks under `bufs`.
fn chunks(bufs: &[Buffer]) -> Vec<(usize, usize)> {
    let mut c: Vec<_> = bufs.iter().map(|b| chunk_of(b.as_ptr()).expect("in a chunk")).collect();
    c.sort();
    c.dedup();
    c
}

fn resident_in(chunks: &[(usize, usize)]) -> usize {
    chunks.iter().map(|&(b, l)| resident(b, l)).sum()
}

/// 48 MiB in 1 MiB buffers, every page written.
fn burst(heap: &Heap) -> Vec<Buffer> {
    (0..48)
        .map(|_| {
            let mut b = heap.alloc(MIB).unwrap();
            b.fill(1);
            b
        })
        .collect()
}

/// jemalloc's decay takes in what was freed at its next run after the free, and releases it an
/// interval later (runs here on demand: `Heap::decay`; in a program, as a side effect of
/// allocations).
fn wait_idle(heap: &Heap, interval: Duration) {
    heap.decay().unwrap();
    std::thread::sleep(interval + interval / 2);
    heap.decay().unwrap();
}

fn heap(idle: Option<Duration>) -> Heap {
    Heap::builder().idle_release(idle).thread_cache(0).max_chunk(8 * MIB).build().unwrap()
}

#[test]
fn a_burst_is_released_after_the_interval_not_before() {
    let heap = heap(Some(Duration::from_millis(1500)));
    let bufs = burst(&heap);
    let cs = chunks(&bufs);
    let pages = resident_in(&cs);
    assert!(pages >= 48 * MIB / 4096, "the burst is resident: {pages} pages");
    drop(bufs);
    heap.decay().unwrap();
    let s = heap.stats();
    assert_eq!(s.idle_chunks, 0, "released before the interval: {s:?}");
    std::thread::sleep(Duration::from_millis(1800));
    heap.decay().unwrap();
    let s = heap.stats();
    let after = resident_in(&cs);
    println!("chunks {} idle {} ({} bytes); resident pages {pages} -> {after}", cs.len(), s.idle_chunks, s.idle_bytes);
    assert!(after < pages / 8, "the burst's pages stayed: {pages} -> {after}");
    assert!(s.idle_chunks as usize + 1 >= cs.len(), "idle chunks {} of the burst's {}", s.idle_chunks, cs.len());
    assert_eq!(s.mapped_bytes, heap.stats().mapped_bytes);
    // Used again: zeroed memory from the same chunks, no longer idle.
    let again: Vec<Buffer> = (0..48).map(|_| heap.alloc(MIB).unwrap()).collect();
    assert!(again.iter().all(|b| b.iter().all(|&x| x == 0)), "reused memory is not zero");
    assert!(heap.stats().idle_chunks < s.idle_chunks);
}

#[test]
fn nothing_is_released_with_the_interval_off() {
    let heap = heap(None);
    let bufs = burst(&heap);
    let cs = chunks(&bufs);
    let pages = resident_in(&cs);
    drop(bufs);
    wait_idle(&heap, Duration::from_millis(200));
    assert_eq!(heap.stats().idle_chunks, 0);
    assert_eq!(resident_in(&cs), pages, "pages went back with idle release off");
}

#[test]
fn reserved_chunks_are_never_released() {
    let heap = heap(Some(Duration::from_millis(100)));
    heap.reserve(96 * MIB).unwrap();
    let mapped = heap.stats().mapped_bytes;
    let bufs = burst(&heap);
    assert_eq!(heap.stats().mapped_bytes, mapped, "the burst fits the reservation");
    let cs = chunks(&bufs);
    let pages = resident_in(&cs);
    drop(bufs);
    wait_idle(&heap, Duration::from_millis(100));
    heap.purge().unwrap();
    assert_eq!(heap.stats().idle_chunks, 0);
    assert_eq!(resident_in(&cs), pages, "reserved pages went back");
}

#[test]
fn a_chunk_with_a_live_buffer_keeps_its_pages() {
    let heap = heap(Some(Duration::from_millis(100)));
    let bufs = burst(&heap);
    // A small buffer stays live in one of the burst's chunks, whose other buffers are freed.
    let mut live = heap.alloc(4096).unwrap();
    live.fill(7);
    let chunk = chunk_of(live.as_ptr()).unwrap();
    assert!(bufs.iter().any(|b| chunk_of(b.as_ptr()) == Some(chunk)), "the live buffer shares a burst chunk");
    drop(bufs);
    wait_idle(&heap, Duration::from_millis(100));
    let decayed = heap.stats().idle_chunks;
    heap.purge().unwrap();
    assert!(decayed > 0, "the other chunks were released (else this shows nothing)");
    assert!(live.iter().all(|&x| x == 7), "a live buffer's bytes went");
    assert!(resident(chunk.0, chunk.1) > 0, "the live buffer's chunk was released");
}

/// A thread's cached buffers keep their chunks busy; `Heap::flush_thread_cache` hands them back
/// and the chunks go idle at the next interval.
#[test]
fn a_flushed_thread_cache_lets_its_chunks_go_idle() {
    let interval = Duration::from_millis(500);
    // The default thread cache (4 MiB): the burst's 1 MiB buffers are cached as they are freed.
    let heap = Heap::builder().idle_release(Some(interval)).max_chunk(8 * MIB).build().unwrap();
    let bufs = burst(&heap);
    let cs = chunks(&bufs);
    let pages = resident_in(&cs);
    drop(bufs);
    assert!(heap.stats().thread_cached_bytes >= MIB as u64, "{:?}", heap.stats());
    wait_idle(&heap, interval);
    let kept = heap.stats().idle_chunks;
    heap.flush_thread_cache().unwrap();
    assert_eq!(heap.stats().thread_cached_bytes, 0, "flushed");
    wait_idle(&heap, interval);
    let s = heap.stats();
    let after = resident_in(&cs);
    println!(
        "chunks {}: idle {kept} with the cache, {} after the flush; pages {pages} -> {after}",
        cs.len(),
        s.idle_chunks
    );
    assert!(s.idle_chunks > kept, "the flush released nothing more: {kept} -> {}", s.idle_chunks);
    assert!(after < pages / 8, "the burst's pages stayed: {pages} -> {after}");
    // The cache works on after a flush.
    let b = heap.alloc(MIB).unwrap();
    drop(b);
    assert!(heap.stats().thread_cached_bytes >= MIB as u64);
}
