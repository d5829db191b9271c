//! `tracing` events for new chunks, deferred out of the extent hook.
//!
//! A chunk is made inside jemalloc's alloc hook, while jemalloc holds its own locks (the arena's
//! grow mutex; at heap creation its global control mutex). A subscriber may do anything there —
//! allocate from a heap that has to grow too, read jemalloc statistics, block on another thread —
//! so the hook only notes what happened in a thread-local record, and the thread emits the
//! events once jemalloc has returned ([`emit_pending`], called by the heap's slow paths).

use std::cell::Cell;
use std::time::Duration;

/// What the hook notes about one new chunk (plain data: nothing allocates).
#[derive(Clone, Copy)]
pub(crate) struct ChunkEvent {
    pub(crate) heap: u64,
    pub(crate) bytes: usize,
    pub(crate) node: Option<u32>,
    pub(crate) metadata: bool,
    pub(crate) registrations: usize,
    pub(crate) map: Duration,
    pub(crate) register: Duration,
}

/// Events kept per thread until emitted; more chunks in one jemalloc call are counted only.
const KEPT: usize = 4;

thread_local! {
    /// How many chunks the hooks made on this thread since the last [`emit_pending`]: read on
    /// every slow-path allocation, so kept apart from the events themselves (a few hundred
    /// bytes, copied only when there is something to emit).
    static NOTED: Cell<usize> = const { Cell::new(0) };
    static PENDING: Cell<[Option<ChunkEvent>; KEPT]> = const { Cell::new([None; KEPT]) };
}

/// Notes `e` for [`emit_pending`] (inside the hook: no allocation, no lock, no panic; nothing
/// if the thread is exiting).
pub(crate) fn note(e: ChunkEvent) {
    let Ok(n) = NOTED.try_with(Cell::get) else { return };
    if n < KEPT {
        let _ = PENDING.try_with(|p| {
            let mut kept = p.get();
            kept[n] = Some(e);
            p.set(kept);
        });
    }
    let _ = NOTED.try_with(|c| c.set(n + 1));
}

/// Emits the events the hooks noted on this thread (outside jemalloc). Called after every
/// allocation that reached jemalloc: inline, one thread-local read when nothing was noted.
#[inline(always)]
pub(crate) fn emit_pending() {
    if NOTED.try_with(Cell::get).is_ok_and(|n| n != 0) {
        emit_noted();
    }
}

/// [`emit_pending`] once a chunk was noted.
#[cold]
#[inline(never)]
fn emit_noted() {
    let Ok(n) = NOTED.try_with(|c| c.replace(0)) else { return };
    let Ok(kept) = PENDING.try_with(|p| p.replace([None; KEPT])) else { return };
    // New chunks may have been kept out of fork children without a record.
    crate::fork::report_unrecorded_holes();
    for e in kept.iter().flatten() {
        tracing::debug!(
            target: "mralloc::heap",
            heap = e.heap,
            bytes = e.bytes,
            node = e.node.map_or(-1, i64::from),
            metadata = e.metadata,
            registrations = e.registrations,
            map_us = e.map.as_micros() as u64,
            register_us = e.register.as_micros() as u64,
            "new chunk mapped, bound and registered"
        );
    }
    if n > KEPT {
        tracing::debug!(target: "mralloc::heap", more = n - KEPT, "more new chunks in the same allocation");
    }
}
