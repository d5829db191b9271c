//! Chunks: the big, registered mappings jemalloc carves allocations from.
//!
//! A chunk is mapped slot-aligned (2 MiB), NUMA-bound before any page is touched, prepared for
//! `fork()` (see `crate::fork`: copied into children, or kept out of them), advised to use
//! transparent huge pages if its heap is bound to a device (and asks for them), then — unless it is
//! jemalloc's metadata, which is never registered — registered with every PD its heap is bound to (and, for
//! memory a fork child needs, marked `MADV_DOFORK` again where rdma-core marked it otherwise:
//! [`keep_in_children`]). Its record lives in a fixed, statically allocated table (never on a heap,
//! so the extent hooks can use it while jemalloc holds its locks); the page map points at it.

use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::fork::{ForkGuard, ForkLock};
use rdma_sys as ffi;

use crate::heap::pagemap::{PAGEMAP, SLOT};

/// PDs one heap can be registered with at once (multi-device registration).
pub const MAX_PDS: usize = 4;
/// Chunks alive at once, over all heaps of the process.
pub(crate) const MAX_CHUNKS: usize = 1 << 15;

/// The record of one chunk. All fields are atomics so lookups never lock.
pub(crate) struct ChunkRec {
    pub(crate) base: AtomicUsize,
    pub(crate) len: AtomicUsize,
    /// Id of the owning heap; 0 = free record.
    pub(crate) owner: AtomicU64,
    /// Looks like jemalloc metadata (a base block): never registered (no buffer lies there),
    /// never kept out of fork children (jemalloc's fork handlers touch it), no THP advice.
    pub(crate) meta: AtomicBool,
    /// A registration `Owner::bind` made but has not published yet (touched only under the
    /// owner's `bound` lock): published when every chunk registered, rolled back otherwise.
    pub(crate) staged: AtomicPtr<ffi::ibv_mr>,
    /// Registration per PD slot of the owning heap (NULL = not registered with that slot).
    pub(crate) mrs: [AtomicPtr<ffi::ibv_mr>; MAX_PDS],
    /// `(lkey << 32) | rkey`, written before the matching `mrs` entry is published.
    pub(crate) keys: [AtomicU64; MAX_PDS],
    /// Set when a registration of this chunk could not be removed: never unmap it.
    pub(crate) leaked: AtomicBool,
    /// The access bits its registrations have (the same for every PD), written before each
    /// `mrs` entry is published.
    pub(crate) access: AtomicU32,
    /// The PD of each registration, copied out of the `ibv_mr` when it is published, so that
    /// lookups never dereference an `ibv_mr` (another thread may be deregistering it).
    pub(crate) pds: [AtomicPtr<ffi::ibv_pd>; MAX_PDS],
    /// Idle release (see `heap::idle`): bytes jemalloc holds decommitted, whether every one of
    /// them reads as zero, whether the whole chunk is released (registered nowhere, no pages),
    /// and whether it must never be (`Heap::reserve`). Written under the owner's `bound`.
    pub(crate) decommitted: AtomicUsize,
    pub(crate) pristine: AtomicBool,
    pub(crate) idle: AtomicBool,
    pub(crate) kept: AtomicBool,
    next_free: AtomicU32,
}

impl ChunkRec {
    // Only used to initialise the static table, element by element.
    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: ChunkRec = ChunkRec {
        base: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        owner: AtomicU64::new(0),
        meta: AtomicBool::new(false),
        staged: AtomicPtr::new(ptr::null_mut()),
        mrs: [const { AtomicPtr::new(ptr::null_mut()) }; MAX_PDS],
        keys: [const { AtomicU64::new(0) }; MAX_PDS],
        pds: [const { AtomicPtr::new(ptr::null_mut()) }; MAX_PDS],
        leaked: AtomicBool::new(false),
        access: AtomicU32::new(0),
        decommitted: AtomicUsize::new(0),
        pristine: AtomicBool::new(true),
        idle: AtomicBool::new(false),
        kept: AtomicBool::new(false),
        next_free: AtomicU32::new(u32::MAX),
    };

    /// `(lkey, rkey)` for PD slot `slot`, if registered.
    #[inline]
    pub(crate) fn keys(&self, slot: usize) -> Option<(u32, u32)> {
        if self.mrs[slot].load(Ordering::Acquire).is_null() {
            return None;
        }
        let k = self.keys[slot].load(Ordering::Relaxed);
        Some(((k >> 32) as u32, k as u32))
    }

    /// The registration of `slot` if it belongs to `pd` (no dereference of the `ibv_mr`).
    /// Registrations are published after their keys and PD, and withdrawn when the chunk is
    /// released or its slot's device removed (`Owner::unbind_removed`, which leaves the
    /// `ibv_mr` alive until its PD is dropped: a request naming it is never left dangling).
    #[inline]
    pub(crate) fn mr_in(&self, slot: usize, pd: *mut ffi::ibv_pd) -> Option<*mut ffi::ibv_mr> {
        let mr = self.mrs[slot].load(Ordering::Acquire);
        if mr.is_null() || self.pds[slot].load(Ordering::Acquire) != pd {
            return None;
        }
        // Still the registration the PD was read for: a device removal may have withdrawn `mr`
        // and the slot been bound to `pd` since (then `mr` may be freed already).
        (self.mrs[slot].load(Ordering::Acquire) == mr).then_some(mr)
    }

    /// The local key of this chunk's registration with `pd`, if it has one (as
    /// [`ChunkRec::mr_in`] finds it).
    #[inline]
    pub(crate) fn lkey_in(&self, pd: *mut ffi::ibv_pd) -> Option<u32> {
        let (slot, _) = self.registration_in(pd)?;
        // Written before the registration was published (`mr_in` read it with acquire).
        Some((self.keys[slot].load(Ordering::Relaxed) >> 32) as u32)
    }

    /// The slot and registration of this chunk in `pd`, if it has one ([`ChunkRec::mr_in`]).
    #[inline]
    pub(crate) fn registration_in(&self, pd: *mut ffi::ibv_pd) -> Option<(usize, *mut ffi::ibv_mr)> {
        (0..MAX_PDS).find_map(|slot| Some((slot, self.mr_in(slot, pd)?)))
    }

    /// Whether the chunk is (or may still be) registered with any PD.
    pub(crate) fn registered(&self) -> bool {
        self.leaked.load(Ordering::Relaxed)
            || !self.staged.load(Ordering::Relaxed).is_null()
            || self.mrs.iter().any(|m| !m.load(Ordering::Acquire).is_null())
    }

    /// Publishes a registration for `slot`, made with `access` (`IBV_ACCESS_*` bits).
    pub(crate) fn set_mr(&self, slot: usize, mr: *mut ffi::ibv_mr, access: u32) {
        // SAFETY: mr is a live registration made by the caller.
        let (lkey, rkey, pd) = unsafe { ((*mr).lkey, (*mr).rkey, (*mr).pd) };
        self.keys[slot].store((u64::from(lkey) << 32) | u64::from(rkey), Ordering::Relaxed);
        self.pds[slot].store(pd, Ordering::Relaxed);
        self.access.store(access, Ordering::Relaxed);
        self.mrs[slot].store(mr, Ordering::Release);
    }
}

static TABLE: [ChunkRec; MAX_CHUNKS] = [const { ChunkRec::EMPTY }; MAX_CHUNKS];

pub(crate) struct FreeList {
    /// Records never used yet start here.
    fresh: u32,
    /// Head of the list of released records (u32::MAX = empty).
    head: u32,
}

/// Taken inside jemalloc's hooks, so it never allocates (parking_lot's first park on a thread
/// would re-enter the allocator); a fork()ed child finds it unlocked (see `crate::fork`).
pub(crate) static ALLOC: ForkLock<FreeList> = ForkLock::new(FreeList { fresh: 0, head: u32::MAX });

/// `ALLOC`, held; in a fork()ed child whose parent held it mid-update, the free list is dropped
/// (its records leak: a torn list could hand out a record twice).
fn alloc_lock() -> ForkGuard<'static, FreeList> {
    let mut fl = ALLOC.lock();
    if fl.after_fork {
        fl.head = u32::MAX;
    }
    fl
}

/// The record at `index`.
#[inline]
pub(crate) fn rec(index: u32) -> &'static ChunkRec {
    &TABLE[index as usize]
}

/// The chunk containing `addr`, if any heap mapped it.
#[inline]
pub(crate) fn find(addr: usize) -> Option<(u32, &'static ChunkRec)> {
    let i = PAGEMAP.get(addr)?;
    let r = rec(i);
    find_in(r, addr).map(|_| (i, r))
}

/// The chunk containing `addr`, if any heap mapped it, with its base and length (read once,
/// for the check).
#[inline]
pub(crate) fn find_span(addr: usize) -> Option<(&'static ChunkRec, usize, usize)> {
    let r = rec(PAGEMAP.get(addr)?);
    find_in(r, addr).map(|(base, len)| (r, base, len))
}

/// `(base, len)` of `r` if it is a chunk a heap mapped that holds `addr`.
#[inline(always)]
fn find_in(r: &ChunkRec, addr: usize) -> Option<(usize, usize)> {
    let base = r.base.load(Ordering::Acquire);
    let len = r.len.load(Ordering::Acquire);
    (addr >= base && addr - base < len && r.owner.load(Ordering::Acquire) != 0).then_some((base, len))
}

/// The record of the chunk holding all of `[addr, addr + len)` (`len` at least 1), if a heap
/// handed it out.
#[inline]
pub(crate) fn find_range(addr: usize, len: usize) -> Option<&'static ChunkRec> {
    let r = rec(PAGEMAP.get(addr)?);
    let base = r.base.load(Ordering::Acquire);
    let end = addr.checked_add(len)?;
    (addr >= base && end <= base + r.len.load(Ordering::Acquire) && r.owner.load(Ordering::Acquire) != 0).then_some(r)
}

/// Records a new chunk for `owner` and publishes it in the page map. `None` when the table is
/// full or the page map could not grow.
pub(crate) fn publish(owner: u64, base: usize, len: usize, meta: bool) -> Option<u32> {
    let index = {
        let mut fl = alloc_lock();
        if fl.head != u32::MAX {
            let i = fl.head;
            fl.head = rec(i).next_free.load(Ordering::Relaxed);
            i
        } else if (fl.fresh as usize) < MAX_CHUNKS {
            fl.fresh += 1;
            fl.fresh - 1
        } else {
            return None;
        }
    };
    let r = rec(index);
    r.base.store(base, Ordering::Relaxed);
    r.len.store(len, Ordering::Relaxed);
    r.meta.store(meta, Ordering::Relaxed);
    r.decommitted.store(0, Ordering::Relaxed);
    r.pristine.store(true, Ordering::Relaxed);
    r.idle.store(false, Ordering::Relaxed);
    r.kept.store(false, Ordering::Relaxed);
    r.owner.store(owner, Ordering::Release);
    if !PAGEMAP.insert(base, len, index) {
        release(index);
        return None;
    }
    Some(index)
}

/// Returns a record to the free list (its registrations must already be gone).
pub(crate) fn release(index: u32) {
    let r = rec(index);
    PAGEMAP.remove(r.base.load(Ordering::Relaxed), r.len.load(Ordering::Relaxed));
    r.owner.store(0, Ordering::Release);
    for m in &r.mrs {
        m.store(ptr::null_mut(), Ordering::Release);
    }
    let mut fl = alloc_lock();
    r.next_free.store(fl.head, Ordering::Relaxed);
    fl.head = index;
}

/// Every live record owned by `owner` (scans the used part of the table).
pub(crate) fn owned_by(owner: u64) -> impl Iterator<Item = (u32, &'static ChunkRec)> {
    let used = alloc_lock().fresh;
    (0..used).map(|i| (i, rec(i))).filter(move |(_, r)| r.owner.load(Ordering::Acquire) == owner)
}

/// Maps `len` bytes aligned to `max(align, SLOT)`. Returns the base or the errno.
pub(crate) fn map(len: usize, align: usize) -> Result<usize, i32> {
    let align = align.max(SLOT);
    if !align.is_power_of_two() {
        return Err(libc::EINVAL);
    }
    let total = len.checked_add(align).ok_or(libc::ENOMEM)?;
    // SAFETY: anonymous private mapping at a kernel-chosen address.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(errno());
    }
    let start = p as usize;
    let base = (start + align - 1) & !(align - 1);
    let head = base - start;
    let tail = total - head - len;
    // SAFETY: both trims lie inside the mapping we just made and outside [base, base+len).
    unsafe {
        if head > 0 {
            libc::munmap(p, head);
        }
        if tail > 0 {
            libc::munmap((base + len) as *mut libc::c_void, tail);
        }
    }
    Ok(base)
}

/// Unmaps a chunk (all its registrations must be gone).
pub(crate) fn unmap(base: usize, len: usize) {
    // SAFETY: the caller owns the chunk and nothing references it any more.
    unsafe { libc::munmap(base as *mut libc::c_void, len) };
    crate::fork::forget_fork(base, len);
}

/// Advice applied to a fresh chunk before it is touched or registered. `fork`: prepare it for
/// `fork()` children as registered memory ([`crate::fork::advise_fork`]: copied into children
/// where the kernel copies pinned pages, otherwise kept out of them). Returns the errno of a
/// failed `MADV_DONTFORK` (the chunk must then not be used); huge-page advice is a hint only:
/// `hugepages` asks for them, `metadata` (a jemalloc base block) refuses them, even where THP is
/// `always`.
pub(crate) fn advise(base: usize, len: usize, hugepages: bool, fork: bool, metadata: bool) -> Result<(), i32> {
    if fork {
        crate::fork::advise_fork(base, len)?;
    }
    if hugepages {
        advise_hugepages(base, len);
    } else if metadata {
        // jemalloc touches ~90 KiB of a 2 MiB base block: where THP is `always`, its first touch
        // would make all of it one resident huge page (a bound Global has one per arena).
        // SAFETY: [base, base+len) is a mapping the heap owns; advice never changes its contents.
        unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_NOHUGEPAGE) };
    }
    Ok(())
}

/// Asks for transparent huge pages on `[base, base+len)` (a hint: ignored where THP is off).
pub(crate) fn advise_hugepages(base: usize, len: usize) {
    // SAFETY: [base, base+len) is a mapping the heap owns; advice never changes its contents.
    unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
}

/// After `[base, base+len)` was registered: where the process's registrations are not copied
/// into fork children ([`crate::fork::decided_copies`] is `Some(false)`), marks it `MADV_DOFORK`
/// again, for memory a child needs: the global allocator's chunks (the child's whole heap;
/// jemalloc's metadata is never registered, so nothing marks it). rdma-core
/// with fork support enabled (`ibv_fork_init`, `RDMAV_FORK_SAFE`) marks every registration
/// `MADV_DONTFORK` itself, and a child would crash in jemalloc's fork handler; elsewhere this
/// changes nothing (nothing marked the range). Returns the errno of a failed `madvise`.
///
/// The cost: where the kernel does not copy pinned pages, the range is shared copy-on-write
/// with a child, and whichever process writes a page first after the fork gets a new page; if
/// that is the parent, its registrations keep the old page, and the CPU and the NIC diverge.
/// For the global allocator's data it is the caveat `Global::bind` documents.
///
/// Inside the extent hooks: no allocation, no lock (reads the decision made by `Owner::bind`).
pub(crate) fn keep_in_children(base: usize, len: usize) -> Result<(), i32> {
    keep_in_children_given(crate::fork::decided_copies(), base, len)
}

/// [`keep_in_children`] for the decision `copies`.
fn keep_in_children_given(copies: Option<bool>, base: usize, len: usize) -> Result<(), i32> {
    if copies != Some(false) {
        return Ok(());
    }
    // SAFETY: advice on a chunk the caller owns; it changes neither its contents nor its
    // registration (nor rdma-core's reference counts of the range, which only decide when
    // rdma-core itself calls madvise).
    if unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_DOFORK) } != 0 {
        return Err(match errno() {
            0 => libc::EINVAL,
            e => e,
        });
    }
    Ok(())
}

/// Registers `[base, base+len)` with `pd`. Returns the MR or the errno.
pub(crate) fn register(pd: *mut ffi::ibv_pd, base: usize, len: usize, access: u32) -> Result<*mut ffi::ibv_mr, i32> {
    // SAFETY: pd is a live PD held by the heap; the range is a chunk the heap owns and keeps
    // mapped until after the MR is deregistered.
    let mr = unsafe { ffi::ibv_reg_mr(pd, base as *mut libc::c_void, len, access as i32) };
    if mr.is_null() {
        Err(match errno() {
            0 => libc::ENOMEM,
            e => e,
        })
    } else {
        Ok(mr)
    }
}

/// Deregisters an MR made by [`register`]. `false` if the device refused: the range is still
/// registered and must stay mapped (leaked). Logs nothing: callers may hold the owner's lock or
/// run inside an extent hook, where logging could allocate; they count the leak
/// (`verbs::leaked_mappings`) and report after unlocking.
#[must_use = "a chunk whose deregistration failed must not be unmapped"]
pub(crate) fn deregister(mr: *mut ffi::ibv_mr) -> bool {
    // SAFETY: mr came from register() and is deregistered once, by the chunk's owner.
    unsafe { ffi::ibv_dereg_mr(mr) == 0 }
}

/// Deregisters every MR in `mrs` (nulls skipped); unmaps the range only if all let go,
/// otherwise leaks it. Returns whether it was unmapped.
pub(crate) fn deregister_and_unmap(mrs: &[*mut ffi::ibv_mr], base: usize, len: usize) -> bool {
    // Every registration is tried, whatever the others do.
    let refused = mrs.iter().filter(|m| !m.is_null()).filter(|&&m| !deregister(m)).count();
    let all = refused == 0;
    if all {
        unmap(base, len);
    } else {
        crate::verbs::LEAKED_MAPPINGS.fetch_add(1, Ordering::Relaxed);
    }
    all
}

pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_is_slot_aligned_and_published() {
        let len = 3 * SLOT + 4096;
        let base = map(len, 4096).unwrap();
        assert_eq!(base % SLOT, 0);
        let owner = u64::MAX - 7;
        let i = publish(owner, base, len, false).unwrap();
        assert_eq!(find(base).map(|(j, _)| j), Some(i));
        assert_eq!(find(base + len - 1).map(|(j, _)| j), Some(i));
        assert!(find(base + len).is_none(), "past the end of the chunk");
        assert!(owned_by(owner).any(|(j, _)| j == i));
        assert_eq!(rec(i).keys(0), None, "not registered");
        release(i);
        assert!(find(base).is_none());
        unmap(base, len);
    }

    /// Where children get no copies, a chunk rdma-core marked `MADV_DONTFORK` at registration
    /// (simulated here) is marked `MADV_DOFORK` again; where they do (or nothing is decided),
    /// it is left alone.
    #[test]
    fn memory_children_need_is_marked_dofork_again() {
        let len = SLOT;
        let base = map(len, SLOT).unwrap();
        let dontfork = || crate::mmap::tests::vm_flags(base).split_whitespace().any(|w| w == "dc");
        // SAFETY: advice on the chunk just mapped, as rdma-core's ibv_reg_mr gives it.
        assert_eq!(unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_DONTFORK) }, 0);
        assert!(dontfork());
        assert_eq!(keep_in_children_given(Some(true), base, len), Ok(()));
        assert_eq!(keep_in_children_given(None, base, len), Ok(()));
        assert!(dontfork(), "copies (or undecided): no advice of mralloc's");
        assert_eq!(keep_in_children_given(Some(false), base, len), Ok(()));
        assert!(!dontfork(), "no copies: MADV_DOFORK again");
        assert_eq!(keep_in_children_given(Some(false), base + 1, len - 1), Err(libc::EINVAL), "a failure is reported");
        unmap(base, len);
    }

    #[test]
    fn big_alignment() {
        let base = map(SLOT, 8 * SLOT).unwrap();
        assert_eq!(base % (8 * SLOT), 0);
        unmap(base, SLOT);
        assert_eq!(map(SLOT, 3 * SLOT), Err(libc::EINVAL));
    }

    /// A chunk as high in the address space as this kernel maps (tried from the top of 57-, 52-
    /// and 48-bit spaces down to 47 bits, with `MAP_FIXED_NOREPLACE`: on a 5-level-paging
    /// x86_64 or a 52-bit aarch64 kernel the chunk lies above 2^47, where the old 47-bit page map
    /// failed with "the chunk table is full") is published and found at both ends.
    #[test]
    fn a_chunk_high_in_the_address_space_is_published() {
        let len = 2 * SLOT;
        let mut placed = None;
        'bits: for bits in [57u32, 52, 48, 47] {
            for k in 1..64usize {
                // 16 GiB steps below the top.
                let hint = (1usize << bits) - k * (1usize << 34);
                // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; a fresh
                // anonymous mapping or MAP_FAILED comes back.
                let p = unsafe {
                    libc::mmap(
                        hint as *mut libc::c_void,
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    continue;
                }
                if p as usize == hint {
                    placed = Some((hint, bits));
                    break 'bits;
                }
                unmap(p as usize, len); // a kernel that ignored the flag: not where we asked
            }
        }
        let (base, bits) = placed.expect("no address below 2^47 could be mapped");
        println!("chunk mapped at {base:#x} (top of the {bits}-bit space this kernel allows)");
        let owner = u64::MAX - 9;
        let i = publish(owner, base, len, false).expect("a high chunk is published");
        assert_eq!(find(base).map(|(j, _)| j), Some(i));
        assert_eq!(find(base + len - 1).map(|(j, _)| j), Some(i));
        release(i);
        assert!(find(base).is_none());
        unmap(base, len);
    }

    /// Lookups (`mr_of` / `keys_of_for`) run concurrently with heap teardown, which frees the
    /// `ibv_mr` structs: they must decide from the record alone. A record whose MR pointer is
    /// not even mapped memory answers without faulting (the old code read `(*mr).pd`).
    #[test]
    fn lookups_never_dereference_a_registration() {
        let rec = ChunkRec::EMPTY;
        let bogus = 0x10 as *mut ffi::ibv_mr; // the zero page: a dereference would fault
        let pd = 0x1000 as *mut ffi::ibv_pd;
        rec.keys[0].store((7u64 << 32) | 9, Ordering::Relaxed);
        rec.pds[0].store(pd, Ordering::Relaxed);
        rec.mrs[0].store(bogus, Ordering::Release);
        assert_eq!(rec.mr_in(0, pd), Some(bogus));
        assert_eq!(rec.mr_in(0, 0x2000 as *mut ffi::ibv_pd), None, "another PD");
        assert_eq!(rec.mr_in(1, pd), None, "an empty slot");
        assert_eq!(rec.keys(0), Some((7, 9)));
    }
}
