//! Giving memory back: the purge of unregistered memory, and idle release — a chunk jemalloc has
//! not used for the heap's idle interval is deregistered and its pages go back to the OS; the
//! next use of it registers it again.
//!
//! jemalloc 5.3 never hands retained memory back to the hooks (only `arena.N.destroy` does), and
//! a chunk's free space is split over its caches (dirty extents, retained ones, the unused rest
//! of each growth), so a whole chunk is never seen free through `dalloc`. Its *commit state* is:
//! the alloc hook maps data chunks uncommitted when jemalloc lets it (the growth path does), and
//! the commit and decommit hooks keep, per chunk, the bytes jemalloc holds decommitted. jemalloc
//! commits what it carves out for use (an active extent is always committed) and decommits only
//! extents it decayed, i.e. free ones: a chunk whose every byte is decommitted holds no
//! allocation, no thread-cached object and no dirty extent — nothing any code or key can still
//! use. Then (under `bound`, as every registration) its registrations are removed, and only
//! once every one of them is gone its pages are dropped (`MADV_DONTNEED`): the chunk is *idle*,
//! registered nowhere, resident nowhere (unless the application mlock()ed part of it: then the
//! pages stay, and are zeroed when used again), and keeps its address range and page-map entry (jemalloc
//! still names its retained extents there), where lookups find no keys. The commit of any part
//! of it registers it again with every bound PD first (a failure fails the commit: jemalloc then
//! grows by a new chunk, and the allocation fails, with a typed error, only if that fails too).
//!
//! Decay timing is jemalloc's: `dirty_decay_ms` is the interval and `muzzy_decay_ms` -1, so free
//! extents reach the decommit hook about an interval after they were freed (smoothstep decay,
//! run as a side effect of the heap's allocations and frees: no thread of its own), and large
//! frees are not purged eagerly (which `oversize_threshold:0` would otherwise do on every free).
//!
//! While registered, a decommit touches no page (jemalloc's "decommitted" is bookkeeping here:
//! the NIC's pages stay the CPU's); jemalloc assumes decommitted memory reads as zero when it is
//! committed again, so the commit hook zeroes what it commits unless the chunk is *pristine*
//! (every decommitted byte still zero: fresh, or dropped since). Unbound, a decommit drops the
//! range's pages at once (`MADV_DONTNEED`, as the purge hook does).
//!
//! Never released: jemalloc's metadata, chunks made by `Heap::reserve` (`kept`), chunks a
//! registration of which could not be removed (`leaked`), and chunks registered with remote
//! rights (whole-chunk rkeys may be in a peer's hands for the heap's life: they are never
//! revoked by releasing). A buffer's own registration (`Buffer::remote`/`expose`) or a window
//! bound over it lives with the buffer, an allocation, so its chunk is not idle meanwhile.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::heap::chunk::{self, ChunkRec, MAX_PDS};
use crate::heap::hook_error::{hook_failed, HookError, Registering};
use crate::heap::owner::Owner;

/// Default idle interval: jemalloc's own `dirty_decay_ms` default (10 s).
pub const DEFAULT_IDLE_RELEASE: Duration = Duration::from_secs(10);

/// `dirty_decay_ms` for an idle interval (`None`: off, -1). Capped far below jemalloc's limit.
pub(crate) const fn decay_ms(idle: Option<Duration>) -> i64 {
    match idle {
        None => -1,
        Some(d) => {
            let ms = d.as_millis();
            if ms > 1_000_000_000_000 {
                1_000_000_000_000
            } else {
                ms as i64
            }
        }
    }
}

impl Owner {
    /// Whether idle release is on for this owner.
    fn idle_on(&self) -> bool {
        self.idle_ms.load(Ordering::Relaxed) >= 0
    }

    /// Purges `[start, start+len)` (free memory of this owner's arena, as jemalloc asks) with
    /// `MADV_DONTNEED` — only while no PD is bound and the range's chunk holds no registration
    /// (published, staged, or leaked by a failed rollback). Holding `bound` keeps a concurrent
    /// bind from registering the range meanwhile. Returns whether it purged (jemalloc then
    /// knows the pages read as zero).
    pub(crate) fn purge_unregistered(&self, start: usize, len: usize) -> bool {
        if !self.born.here() {
            // A fork()ed child: a parent thread may have held `bound` at the fork. Not purging
            // is always allowed.
            return false;
        }
        let bound = self.lock_bound();
        if bound.pds.iter().any(Option::is_some) {
            return false; // registered memory is never purged
        }
        if chunk::find(start).is_some_and(|(_, rec)| rec.registered() || rec.kept.load(Ordering::Relaxed)) {
            return false; // registered, or reserved (`Heap::reserve`: its pages stay)
        }
        // SAFETY: jemalloc purges only free memory of its own extents (for Global's arena 0 also
        // pre-install, default-mapped ones: plain anonymous memory); nothing is registered there
        // (checked above under `bound`, which every registration takes).
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) == 0 }
    }

    /// The decommit hook: `true` refuses (jemalloc then tries the purge hooks, and retains the
    /// extent committed). Runs inside jemalloc: no allocation, no panic.
    pub(crate) fn decommit(&self, start: usize, len: usize) -> bool {
        if !self.born.here() || !self.idle_on() || len == 0 {
            return true; // a fork()ed child, or idle release off: keep it committed
        }
        let bound = self.lock_bound();
        let Some(rec) = chunk::find_range(start, len).filter(|r| r.owner.load(Ordering::Acquire) == self.id) else {
            return true; // not a chunk of ours (Global's pre-install memory): the purge hooks decide
        };
        if rec.meta.load(Ordering::Relaxed) || rec.kept.load(Ordering::Relaxed) || rec.leaked.load(Ordering::Relaxed) {
            return true;
        }
        if rec.registered() {
            if self.access.is_remote() {
                return true; // a whole-chunk rkey may be out: never deregistered before teardown
            }
            // Bookkeeping only: the pages stay (the NIC's are the CPU's); they keep their bytes.
            rec.pristine.store(false, Ordering::Relaxed);
        } else if !drop_pages(start, len) {
            return true;
        }
        let total = rec.decommitted.fetch_add(len, Ordering::Relaxed) + len;
        if total == rec.len.load(Ordering::Relaxed) {
            self.release_idle(rec);
        }
        drop(bound);
        false
    }

    /// The whole chunk is decommitted (see the module docs): deregisters it, then drops its
    /// pages (if the kernel lets it: not where the application locked memory; the chunk is then
    /// idle but resident, and not pristine). A registration the device refuses to remove stays (the chunk is then `leaked`:
    /// never dropped nor unmapped; the next commit registers the rest again). Under `bound`.
    fn release_idle(&self, rec: &ChunkRec) {
        let len = rec.len.load(Ordering::Relaxed);
        let mut refused = false;
        for slot in 0..MAX_PDS {
            let mr = rec.mrs[slot].swap(std::ptr::null_mut(), Ordering::AcqRel);
            if mr.is_null() {
                continue;
            }
            if chunk::deregister(mr) {
                self.counters.registered[slot].fetch_sub(len as u64, Ordering::Relaxed);
            } else {
                rec.mrs[slot].store(mr, Ordering::Release); // still registered: keys stay true
                refused = true;
            }
        }
        if refused {
            rec.leaked.store(true, Ordering::Relaxed);
            return;
        }
        // Deregistered everywhere: nothing but this mapping refers to the pages. Dropping them
        // fails on a range the application mlock()ed (a freed buffer's VMA stays locked): then
        // the old bytes stay, and the next commit must zero them (jemalloc takes the memory as
        // zeroed).
        let dropped = drop_pages(rec.base.load(Ordering::Relaxed), len);
        rec.pristine.store(dropped, Ordering::Relaxed);
        rec.idle.store(true, Ordering::Relaxed);
        self.counters.idle_chunks.fetch_add(1, Ordering::Relaxed);
        self.counters.idle_bytes.fetch_add(len as u64, Ordering::Relaxed);
        self.counters.idle_releases.fetch_add(1, Ordering::Relaxed);
    }

    /// The commit hook: `true` fails the commit. Registers an idle chunk (or the slots a refused
    /// release left unregistered) with every bound PD first (those it registers with when
    /// mapped: see `heap::lazy`); zeroes the range unless the chunk
    /// is pristine (jemalloc takes committed-again memory as zeroed).
    pub(crate) fn commit(&self, start: usize, len: usize) -> bool {
        let Some(rec) = chunk::find_range(start, len.max(1)).filter(|r| r.owner.load(Ordering::Acquire) == self.id)
        else {
            return false; // not ours: always committed
        };
        if !self.born.here() {
            // A fork()ed child (a parent thread may have held `bound`): nothing is registered
            // here; zero what may hold old bytes.
            if !rec.idle.load(Ordering::Relaxed) {
                zero(start, len);
            }
            rec.decommitted.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        #[cfg(test)]
        if let errno @ 1.. = FAIL_NEXT_COMMIT.try_with(|c| c.replace(0)).unwrap_or(0) {
            hook_failed(self.is_static(), len, HookError::Register(errno, Registering::IdleChunk));
            return true;
        }
        let bound = self.lock_bound();
        let base = rec.base.load(Ordering::Relaxed);
        let size = rec.len.load(Ordering::Relaxed);
        let meta = rec.meta.load(Ordering::Relaxed);
        let mut made = [std::ptr::null_mut(); MAX_PDS];
        for (slot, pd) in bound.pds.iter().enumerate() {
            let Some(pd) = pd.as_ref().filter(|pd| !pd.context().is_removed()) else { continue };
            if !rec.mrs[slot].load(Ordering::Acquire).is_null() {
                continue;
            }
            if !self.registers_at_map(slot, rec.kept.load(Ordering::Relaxed), meta) {
                continue; // registered again on its next use through that PD (`heap::lazy`)
            }
            let t = Instant::now();
            match chunk::register(pd.as_raw(), base, size, self.registration_access()) {
                Ok(mr) => {
                    made[slot] = mr;
                    self.counters.reg_calls.fetch_add(1, Ordering::Relaxed);
                    self.counters.reg_nanos.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    self.counters.reg_failures.fetch_add(1, Ordering::Relaxed);
                    withdraw(rec, &made);
                    drop(bound);
                    hook_failed(self.is_static(), size, HookError::Register(e, Registering::IdleChunk));
                    return true;
                }
            }
        }
        if made.iter().any(|m| !m.is_null()) && self.inherited(meta) {
            if let Err(e) = chunk::keep_in_children(base, size) {
                withdraw(rec, &made);
                drop(bound);
                hook_failed(self.is_static(), size, HookError::Advise(e));
                return true;
            }
        }
        for (slot, &mr) in made.iter().enumerate() {
            if !mr.is_null() {
                rec.set_mr(slot, mr, self.registration_access());
                self.counters.registered[slot].fetch_add(size as u64, Ordering::Relaxed);
            }
        }
        if rec.idle.swap(false, Ordering::Relaxed) {
            self.counters.idle_chunks.fetch_sub(1, Ordering::Relaxed);
            self.counters.idle_bytes.fetch_sub(size as u64, Ordering::Relaxed);
        }
        if !rec.pristine.load(Ordering::Relaxed) {
            zero(start, len);
        }
        rec.decommitted.fetch_sub(len, Ordering::Relaxed);
        drop(bound);
        false
    }

    /// A new chunk's idle-release state: handed to jemalloc uncommitted (all of it counts as
    /// decommitted), and kept for good if a `reserve` runs (`kept`, read once by the caller).
    pub(crate) fn note_commit_state(&self, rec: &ChunkRec, size: usize, uncommitted: bool, kept: bool) {
        if uncommitted {
            rec.decommitted.store(size, Ordering::Relaxed);
        }
        if kept {
            rec.kept.store(true, Ordering::Relaxed);
        }
    }

    /// Marks chunks made from now on as never released (`Heap::reserve`), until the returned
    /// guard is dropped.
    pub(crate) fn keeping(&self) -> Keeping<'_> {
        self.reserving.fetch_add(1, Ordering::AcqRel);
        Keeping(self)
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: the errno with which this thread's next commit of a chunk of a heap fails, as a
    /// refused registration of an idle chunk would (0: none). Per thread: other tests'
    /// allocations go on.
    pub(crate) static FAIL_NEXT_COMMIT: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
}

/// While alive, new chunks of its owner are kept (see [`Owner::keeping`]).
pub(crate) struct Keeping<'a>(&'a Owner);

impl Drop for Keeping<'_> {
    fn drop(&mut self) {
        self.0.reserving.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Deregisters registrations made but not published (a failed commit); one the device refuses
/// to remove leaks the chunk (never dropped nor unmapped).
fn withdraw(rec: &ChunkRec, made: &[*mut rdma_sys::ibv_mr]) {
    for &m in made.iter().filter(|m| !m.is_null()) {
        if !chunk::deregister(m) {
            rec.leaked.store(true, Ordering::Relaxed);
        }
    }
}

/// Drops the pages of `[start, start+len)` (they read as zero afterwards). The caller made sure
/// nothing has them registered.
fn drop_pages(start: usize, len: usize) -> bool {
    // SAFETY: a range of a chunk the heap owns, free in jemalloc's view and registered nowhere
    // (checked by the caller under `bound`); advice changes no mapping, only drops the pages.
    unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) == 0 }
}

/// Zeroes `[start, start+len)`, free memory of a chunk jemalloc is committing.
fn zero(start: usize, len: usize) {
    // SAFETY: a mapped, writable range of a chunk the heap owns, not yet handed to anyone (the
    // commit precedes jemalloc's use of it).
    unsafe { std::ptr::write_bytes(start as *mut u8, 0, len) };
}
