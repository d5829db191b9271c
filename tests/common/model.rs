//! A model-checked random workload over a heap, shared by the host and device tests.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;

use allocator_api2::alloc::Allocator;
use mralloc::heap::{chunk_of, Buffer, Heap};
use proptest::prelude::*;

use super::pattern;

#[derive(Debug, Clone)]
pub enum Op {
    Alloc {
        size: usize,
        align_log2: u32,
    },
    Free(usize),
    Resize(usize, usize),
    Write(usize),
    /// Dirty a block, free it, then `Heap::alloc` the same size: the bytes must read as zeros
    /// (the block handed out is most often the one just freed).
    Zeroed(usize),
    /// Heap-level maintenance between operations ([`Env::maintain`]).
    Maintain(u8),
}

/// What a model run does beyond the allocator calls: host and device differ.
pub trait Env: Sync {
    /// Purge (0) or decay (1) the heap; a device environment adds late binds.
    fn maintain(&self, heap: &Heap, which: u8) {
        if which % 2 == 0 {
            heap.purge().expect("purge");
        } else {
            heap.decay().expect("decay");
        }
    }

    /// Checks a fresh zero-filled buffer beyond the CPU's view (a device reads it by DMA).
    fn check_zeroed(&self, _buf: &Buffer) {}
}

/// The host environment: purge and decay, CPU checks only.
pub struct Host;

impl Env for Host {}

/// Operations with allocation sizes up to `max` bytes.
pub fn op(max: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (prop_oneof![8 => 1usize..4096, 3 => 4096usize..(1 << 20), 1 => (1usize << 20)..max.max((1 << 20) + 1)], 0u32..=12)
            .prop_map(|(size, align_log2)| Op::Alloc { size, align_log2 }),
        3 => any::<usize>().prop_map(Op::Free),
        2 => (any::<usize>(), 1usize..(2 << 20)).prop_map(|(i, n)| Op::Resize(i, n)),
        2 => any::<usize>().prop_map(Op::Write),
        2 => prop_oneof![3 => 1usize..4096, 1 => 4096usize..(256 << 10)].prop_map(Op::Zeroed),
        1 => any::<u8>().prop_map(Op::Maintain),
    ]
}

pub struct Live {
    pub ptr: NonNull<u8>,
    pub layout: Layout,
    pub seed: u64,
}

/// Runs `ops` against `heap` and a model; checks every invariant after each step. Returns the
/// live bytes left (the caller frees nothing: it checks them against the stats, then frees).
pub fn run_model(heap: &Heap, ops: &[Op], salt: u64, env: &dyn Env) -> Vec<Live> {
    let alloc = heap;
    let mut live: Vec<Live> = Vec::new();
    let check = |l: &Live| {
        // SAFETY: l is a live allocation of l.layout.size() bytes.
        let bytes = unsafe { std::slice::from_raw_parts(l.ptr.as_ptr(), l.layout.size()) };
        super::assert_bytes_eq(bytes, &pattern(l.seed, l.layout.size()), "contents preserved");
        assert_eq!(l.ptr.as_ptr() as usize % l.layout.align(), 0, "alignment");
        let first = chunk_of(l.ptr.as_ptr()).expect("first byte lies in a heap chunk");
        let last = chunk_of(l.ptr.as_ptr().wrapping_add(l.layout.size() - 1)).expect("last byte in a chunk");
        assert_eq!(first, last, "an allocation spans exactly one chunk");
        let (kf, kl) = (heap.keys(l.ptr.as_ptr()), heap.keys(l.ptr.as_ptr().wrapping_add(l.layout.size() - 1)));
        assert_eq!(kf, kl, "keys of first and last byte");
        if let Some(k) = kf {
            assert_eq!((k.chunk_base, k.chunk_len), first, "keys are the chunk's");
        }
    };
    for (step, op) in ops.iter().enumerate() {
        let seed = salt ^ (step as u64) << 8;
        match *op {
            Op::Alloc { size, align_log2 } => {
                let layout = Layout::from_size_align(size, 1 << align_log2).unwrap();
                let p = alloc.allocate(layout).expect("allocation").cast::<u8>();
                // SAFETY: fresh allocation of layout.size() bytes.
                unsafe { std::ptr::copy_nonoverlapping(pattern(seed, size).as_ptr(), p.as_ptr(), size) };
                live.push(Live { ptr: p, layout, seed });
            }
            Op::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                check(&l);
                // SAFETY: allocated by `alloc` with l.layout, freed once.
                unsafe { alloc.deallocate(l.ptr, l.layout) };
            }
            Op::Resize(i, new_size) if !live.is_empty() => {
                let k = i % live.len();
                let l = &mut live[k];
                check(l);
                let new = Layout::from_size_align(new_size, l.layout.align()).unwrap();
                // SAFETY: l.ptr was allocated by `alloc` with l.layout.
                let p = unsafe {
                    if new.size() >= l.layout.size() {
                        alloc.grow(l.ptr, l.layout, new)
                    } else {
                        alloc.shrink(l.ptr, l.layout, new)
                    }
                }
                .expect("resize")
                .cast::<u8>();
                let keep = l.layout.size().min(new_size);
                // SAFETY: p is live for new_size bytes.
                let kept = unsafe { std::slice::from_raw_parts(p.as_ptr(), keep) };
                super::assert_bytes_eq(kept, &pattern(l.seed, l.layout.size())[..keep], "resize keeps the prefix");
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(pattern(seed, new_size).as_ptr(), p.as_ptr(), new_size) };
                *l = Live { ptr: p, layout: new, seed };
            }
            Op::Write(i) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                check(l);
                // SAFETY: l is live for its size.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        pattern(seed, l.layout.size()).as_ptr(),
                        l.ptr.as_ptr(),
                        l.layout.size(),
                    )
                };
                l.seed = seed;
            }
            Op::Zeroed(size) => {
                let layout = Layout::from_size_align(size, 1).unwrap();
                let p = alloc.allocate(layout).expect("allocation").cast::<u8>();
                // SAFETY: p is a fresh allocation of `size` bytes, freed once with its layout.
                unsafe {
                    std::ptr::write_bytes(p.as_ptr(), 0xA5, size);
                    alloc.deallocate(p, layout);
                }
                let mut buf = heap.alloc(size).expect("zero-filled allocation");
                let dirty = buf.iter().filter(|&&x| x != 0).count();
                assert_eq!(
                    dirty,
                    0,
                    "Heap::alloc({size}) handed out {dirty} non-zero bytes (reused block: {})",
                    buf.as_ptr() == p.as_ptr()
                );
                env.check_zeroed(&buf);
                buf.fill(0x5A); // freed dirty: the next zero-filled allocation may get it
            }
            Op::Maintain(which) => env.maintain(heap, which),
            _ => {}
        }
    }
    // No overlap among live allocations.
    let mut spans: BTreeMap<usize, usize> = BTreeMap::new();
    for l in &live {
        check(l);
        spans.insert(l.ptr.as_ptr() as usize, l.layout.size());
    }
    let mut end = 0;
    for (&start, &len) in &spans {
        assert!(start >= end, "allocations overlap at {start:#x}");
        end = start + len;
    }
    live
}

// SAFETY note for the test: Live holds raw pointers; it is only moved across the scoped thread
// boundary and used with the heap that allocated it.
pub struct SendLive(pub Vec<Live>);
// SAFETY: the pointers are plain heap memory owned by the vector's user.
unsafe impl Send for SendLive {}
