//! Registration on first use ([`crate::heap::HeapBuilder::register_on_first_use`]): a heap
//! bound to several PDs registers each chunk with its primary PD (slot 0) when jemalloc maps it,
//! and with every other bound PD only the first time memory of that chunk is used through that
//! PD — an operation's local side, a grant, or a key lookup for that PD ([`crate::keys_of_for`],
//! [`crate::heap::Buffer::keys_for`]). On a machine with many NICs where a buffer meets only
//! some of them, that is one registration per chunk up front instead of one per NIC.
//!
//! The registration is the whole chunk's, made under the owner's `bound` lock and published in
//! the chunk's record like one made when the chunk was mapped (`ChunkRec::set_mr`): of two
//! threads racing the first use, the second finds it made once it holds the lock, so there is
//! exactly one. From then on lookups find it lock-free, and every release path (idle release,
//! device removal, the heap's teardown) withdraws and deregisters it as it does the others,
//! because they all walk every slot of the record. A failed registration leaves the record as
//! it was (the next use tries again) and reaches the caller as [`Error::Registration`].
//!
//! Chunks made while [`crate::heap::Heap::reserve`] runs (`kept`) are registered with every PD
//! when mapped, as in the eager mode: a reservation exists to keep registration off the hot
//! path. jemalloc's metadata is never registered on first use: no buffer lies in it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use crate::error::{memlock_text, Error, Result};
use crate::heap::chunk::{self, ChunkRec};
use crate::heap::owner::Owner;
use crate::verbs::Pd;

/// The live owners that register on first use, for lookups that start from a pointer (the page
/// map gives a chunk and its owner's id, not the owner). Touched only when a heap is built and
/// when a lookup for a PD finds no registration, never by the extent hooks, and never while a
/// `bound` lock is held.
static FIRST_USE_OWNERS: Mutex<Vec<(u64, Weak<Owner>)>> = Mutex::new(Vec::new());

/// Lists `owner` as registering on first use (and forgets owners gone since).
pub(crate) fn enroll(owner: &Arc<Owner>) {
    let mut owners = FIRST_USE_OWNERS.lock().unwrap_or_else(PoisonError::into_inner);
    owners.retain(|(_, w)| w.strong_count() > 0);
    owners.push((owner.id, Arc::downgrade(owner)));
}

/// The live owner `id` if it registers on first use.
fn first_use_owner(id: u64) -> Option<Arc<Owner>> {
    let owners = FIRST_USE_OWNERS.lock().unwrap_or_else(PoisonError::into_inner);
    // Only `id`'s is upgraded (an upgraded owner's drop may be this thread's: no other).
    owners.iter().find(|(i, _)| *i == id).and_then(|(_, w)| w.upgrade())
}

impl Owner {
    /// Whether a chunk is registered with the PD bound in `slot` when it is mapped (or bound, or
    /// committed again after an idle release): never jemalloc's metadata (`meta`: no buffer
    /// lies there, and a registration would pin its 2 MiB whole); data chunks always, unless
    /// the heap registers on first use — then only with the primary PD, or a chunk
    /// `Heap::reserve` keeps.
    pub(crate) fn registers_at_map(&self, slot: usize, kept: bool, meta: bool) -> bool {
        !meta && (!self.first_use || slot == 0 || kept)
    }

    /// The slot of `rec`'s registration with `pd`, registering the chunk now if this heap
    /// registers with `pd` on first use and has not yet. Thread-safe: decided under `bound`,
    /// where every registration of the heap is made and withdrawn.
    ///
    /// # Errors
    /// [`Error::NotRegistered`] (`addr`) if the chunk is not this heap's (any more), is
    /// jemalloc's metadata or idle (no buffer lies there), or `pd` is not bound on first use;
    /// [`Error::Registration`] if `ibv_reg_mr` fails (the chunk stays as it was: the next use
    /// tries again); [`Error::Io`] if marking a chunk fork children need `MADV_DOFORK` again
    /// fails; [`Error::Forked`] in a fork()ed child; [`Error::DeviceRemoved`].
    pub(crate) fn register_first_use(&self, rec: &ChunkRec, pd: &Pd, addr: u64) -> Result<usize> {
        self.born.check("this heap")?;
        pd.context().usable_for_new()?;
        let bound = self.lock_bound();
        let Some(slot) = bound.pds.iter().position(|p| p.as_ref() == Some(pd)) else {
            drop(bound);
            return Err(Error::NotRegistered { addr });
        };
        if rec.mr_in(slot, pd.as_raw()).is_some() {
            return Ok(slot); // made meanwhile (the other thread of a race), or eagerly
        }
        // Under `bound`, the record cannot be released (teardown, idle release) meanwhile.
        let ours = rec.owner.load(Ordering::Acquire) == self.id;
        let meta = rec.meta.load(Ordering::Relaxed);
        if !ours || meta || rec.idle.load(Ordering::Relaxed) || self.registers_at_map(slot, false, false) {
            drop(bound);
            return Err(Error::NotRegistered { addr });
        }
        let (base, len) = (rec.base.load(Ordering::Relaxed), rec.len.load(Ordering::Relaxed));
        let t = Instant::now();
        let mr = match register(pd, base, len, self.registration_access()) {
            Ok(mr) => mr,
            Err(errno) => {
                self.counters.reg_failures.fetch_add(1, Ordering::Relaxed);
                drop(bound);
                return Err(Error::Registration {
                    errno,
                    hint: format!(
                        "ibv_reg_mr of a {len}-byte chunk on its first use through a PD failed ({}); \
                         registered memory is pinned: {}",
                        std::io::Error::from_raw_os_error(errno),
                        memlock_text()
                    ),
                });
            }
        };
        self.counters.reg_calls.fetch_add(1, Ordering::Relaxed);
        self.counters.first_use_regs.fetch_add(1, Ordering::Relaxed);
        self.counters.reg_nanos.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if self.inherited(meta) {
            if let Err(errno) = chunk::keep_in_children(base, len) {
                if !chunk::deregister(mr) {
                    rec.leaked.store(true, Ordering::Relaxed); // never unmapped nor released
                    crate::verbs::LEAKED_MAPPINGS.fetch_add(1, Ordering::Relaxed);
                }
                drop(bound);
                return Err(Error::Io {
                    what: "marking a chunk MADV_DOFORK after its registration".into(),
                    source: std::io::Error::from_raw_os_error(errno),
                });
            }
        }
        rec.set_mr(slot, mr, self.registration_access());
        self.counters.registered[slot].fetch_add(len as u64, Ordering::Relaxed);
        drop(bound);
        Ok(slot)
    }
}

/// `chunk::register`, which a test can make fail once ([`FAIL_NEXT`]).
fn register(pd: &Pd, base: usize, len: usize, access: u32) -> std::result::Result<*mut rdma_sys::ibv_mr, i32> {
    #[cfg(test)]
    if let errno @ 1.. = FAIL_NEXT.swap(0, Ordering::Relaxed) {
        return Err(errno);
    }
    chunk::register(pd.as_raw(), base, len, access)
}

/// Tests: the errno the next registration on first use fails with (0: none).
#[cfg(test)]
pub(crate) static FAIL_NEXT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The chunk holding all of `[ptr, ptr+len)` (`len` at least 1) and the slot of its
/// registration with `pd`, registered now if its heap registers with `pd` on first use.
///
/// # Errors
/// [`Error::NotRegistered`] if the range is not inside one chunk of a heap bound to `pd`; what
/// [`Owner::register_first_use`] fails with.
pub(crate) fn registration_for(ptr: *const u8, len: usize, pd: &Pd) -> Result<(&'static ChunkRec, usize)> {
    let addr = ptr as u64;
    let rec = chunk::find_range(ptr as usize, len.max(1)).ok_or(Error::NotRegistered { addr })?;
    if let Some((slot, _)) = rec.registration_in(pd.as_raw()) {
        return Ok((rec, slot));
    }
    let owner = first_use_owner(rec.owner.load(Ordering::Acquire)).ok_or(Error::NotRegistered { addr })?;
    let slot = owner.register_first_use(rec, pd, addr)?;
    Ok((rec, slot))
}

/// The lkey of `[ptr, ptr+len)` in `pd` ([`registration_for`]): what an operation's local side
/// uses when its own lookup found none.
///
/// # Errors
/// As [`registration_for`].
pub(crate) fn lkey_or_register(ptr: *const u8, len: usize, pd: &Pd) -> Result<u32> {
    let (rec, slot) = registration_for(ptr, len, pd)?;
    // Withdrawn meanwhile only by a device removal or a release of memory nobody holds.
    rec.keys(slot).map(|(lkey, _)| lkey).ok_or(Error::NotRegistered { addr: ptr as u64 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::Access;

    /// Only the PDs after the primary one wait for a first use, and not for reserved chunks;
    /// an eager heap registers everything when mapping.
    #[test]
    fn only_secondary_pds_of_a_first_use_heap_wait() {
        let mut owner = Owner::new(Access::LOCAL_WRITE, None, false, usize::MAX, -1);
        assert!((0..chunk::MAX_PDS).all(|s| owner.registers_at_map(s, false, false)), "eager by default");
        assert!((0..chunk::MAX_PDS).all(|s| !owner.registers_at_map(s, true, true)), "metadata never");
        owner.first_use = true;
        assert!(owner.registers_at_map(0, false, false), "the primary PD stays eager");
        assert!((1..chunk::MAX_PDS).all(|s| !owner.registers_at_map(s, false, false)), "the others wait");
        assert!((1..chunk::MAX_PDS).all(|s| owner.registers_at_map(s, true, false)), "reserved chunks do not");
        assert!((0..chunk::MAX_PDS).all(|s| !owner.registers_at_map(s, true, true)), "metadata never");
    }
}
