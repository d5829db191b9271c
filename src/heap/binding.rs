//! Binding a heap to PDs and unbinding it from a removed device's: the registration of every
//! chunk with a new PD (rolled back on failure), and its withdrawal when the device goes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::heap::chunk::{self, MAX_PDS};
use crate::heap::hook_error::{HookError, Registering};
use crate::heap::owner::Owner;
use crate::verbs::removal::{self, Subscription};
use crate::verbs::{Context, Pd};

impl Owner {
    /// [`Owner::bind`] for a scoped heap: the removal watch holds the owner weakly.
    pub(crate) fn bind_shared(self: &Arc<Self>, pd: &Pd) -> Result<usize> {
        let owner = Arc::downgrade(self);
        self.bind(
            pd,
            Arc::new(move |ctx: &Context| {
                if let Some(owner) = owner.upgrade() {
                    owner.unbind_removed(ctx);
                }
            }),
        )
    }

    /// [`Owner::bind`] for the global allocator.
    #[cfg(feature = "global")]
    pub(crate) fn bind_static(&'static self, pd: &Pd) -> Result<usize> {
        self.bind(pd, Arc::new(move |ctx: &Context| self.unbind_removed(ctx)))
    }

    /// Registers every chunk so far, and every later one, with `pd` (for a heap registering on
    /// first use, a PD after the primary one: only the reserved chunks now, the others on
    /// their first use through it, see `heap::lazy`). Returns the PD's slot.
    /// When `pd`'s device is removed, `on_removed` (which calls [`Owner::unbind_removed`]) runs
    /// on the liveness thread (the device monitor's).
    ///
    /// Nothing here allocates while `bound` is held: the alloc hook takes the same lock, and
    /// for the global allocator every allocation may need a new chunk (a `Vec` push under the
    /// lock deadlocked, alone or with a thread holding jemalloc's grow mutex). Registrations are
    /// published into the chunk records as they are made and rolled back from there.
    fn bind(&self, pd: &Pd, on_removed: removal::Callback) -> Result<usize> {
        self.born.check("this heap")?;
        pd.context().usable_for_new()?;
        // Decided before any lock (the first answer may allocate: for the global allocator,
        // through the hooks, which take `bound`); the hooks then read it when they register.
        crate::fork::children_copy_pinned_pages();
        let _binding = self.binding.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let started = Instant::now();
        let mut bound = self.lock_bound();
        if let Some(slot) = bound.pds.iter().position(|p| p.as_ref() == Some(pd)) {
            return Ok(slot);
        }
        let Some(slot) = bound.pds.iter().position(Option::is_none) else {
            drop(bound);
            return Err(Error::InvalidArgument(format!("a heap can be bound to at most {MAX_PDS} PDs")));
        };
        // Register every chunk into its record's staging field; publish only when all
        // succeeded (readers never see a registration a rollback could withdraw).
        let mut failed: Option<(HookError, usize)> = None;
        // The first binding: the data chunks mapped unbound get the huge-page advice now (a
        // hint: pages already there are collapsed by the kernel in the background, if at all).
        let first = bound.pds.iter().all(Option::is_none);
        for (_, rec) in chunk::owned_by(self.id) {
            if rec.idle.load(Ordering::Relaxed) {
                continue; // released (no pages): registered when jemalloc commits it again
            }
            let base = rec.base.load(Ordering::Relaxed);
            let len = rec.len.load(Ordering::Relaxed);
            let meta = rec.meta.load(Ordering::Relaxed);
            if first && self.hugepages && !meta {
                chunk::advise_hugepages(base, len);
            }
            if !self.registers_at_map(slot, rec.kept.load(Ordering::Relaxed), meta) {
                continue; // registered on its first use through `pd` (`heap::lazy`)
            }
            let t = Instant::now();
            match chunk::register(pd.as_raw(), base, len, self.registration_access()) {
                Ok(mr) => {
                    self.counters.reg_calls.fetch_add(1, Ordering::Relaxed);
                    self.counters.reg_nanos.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    rec.staged.store(mr, Ordering::Relaxed);
                    // Memory a fork child needs, which rdma-core may just have marked
                    // MADV_DONTFORK (see `chunk::keep_in_children`).
                    if self.inherited(meta) {
                        if let Err(errno) = chunk::keep_in_children(base, len) {
                            failed = Some((HookError::Advise(errno), len));
                            break;
                        }
                    }
                }
                Err(errno) => {
                    self.counters.reg_failures.fetch_add(1, Ordering::Relaxed);
                    failed = Some((HookError::Register(errno, Registering::Bind), len));
                    break;
                }
            }
        }
        let mut leaked = 0u64;
        for (_, rec) in chunk::owned_by(self.id) {
            let mr = rec.staged.swap(std::ptr::null_mut(), Ordering::Relaxed);
            if mr.is_null() {
                continue;
            }
            if failed.is_none() {
                rec.set_mr(slot, mr, self.registration_access());
                self.counters.registered[slot].fetch_add(rec.len.load(Ordering::Relaxed) as u64, Ordering::Relaxed);
            } else if !chunk::deregister(mr) {
                // Still registered with `pd`: the chunk must never be unmapped nor purged.
                rec.leaked.store(true, Ordering::Relaxed);
                leaked += 1;
            }
        }
        if let Some((error, len)) = failed {
            drop(bound);
            if leaked > 0 {
                tracing::error!(leaked, "rolling back a failed bind: ibv_dereg_mr refused; those chunks stay mapped");
            }
            return Err(error.into_error(len));
        }
        bound.pds[slot] = Some(pd.clone());
        let chunks = chunk::owned_by(self.id).count();
        let bytes = self.counters.registered[slot].load(Ordering::Relaxed);
        drop(bound);
        // Subscribed after the bind: a removal in between is reported at once (`subscribe`).
        match removal::subscribe(pd.context(), on_removed) {
            Ok(sub) => self.lock_watches()[slot] = Some(sub),
            Err(e) => tracing::warn!("the heap will not notice its device's removal: {e}"),
        }
        // After the lock: a subscriber may allocate (see `bind`'s docs).
        tracing::info!(
            target: "mralloc::heap",
            heap = self.id,
            slot,
            chunks,
            bytes,
            elapsed_us = started.elapsed().as_micros() as u64,
            first_use = !self.registers_at_map(slot, false, false),
            "bound to a protection domain: its data chunks registered (on first use: the reserved ones)"
        );
        Ok(slot)
    }

    fn lock_watches(&self) -> std::sync::MutexGuard<'_, [Option<Subscription>; MAX_PDS]> {
        self.watches.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `ctx`'s device was removed: withdraws every chunk's registration with each PD of that
    /// device and unbinds the PD. The registrations go to their PD ([`Pd::retire`]), which
    /// deregisters them when it is dropped: a queue pair of that PD may still be about to
    /// name one. The kernel finishes removing a device like rxe once every registration, PD
    /// and context on it is gone — the heap's own are gone from it now.
    ///
    /// (Buffers exposed with `Buffer::remote` hold a registration of their own in the PD
    /// until revoked or dropped.) The heap keeps its memory and works as an unbound heap; it
    /// can be bound to a PD of another (or the re-added) device. The chunks stay registered
    /// with the removed device until that PD is gone, so they are never purged nor unmapped
    /// from here on (marked leaked; the heap's drop leaves them mapped).
    pub(crate) fn unbind_removed(&self, ctx: &Context) {
        if !self.born.here() {
            return;
        }
        let _binding = self.binding.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Room for every registration, reserved before locking (nothing allocates under
        // `bound`); chunks are published under `bound`, so the count cannot grow once held.
        let mut withdrawn: Vec<(usize, *mut rdma_sys::ibv_mr)> = Vec::new();
        let mut bound = loop {
            withdrawn.reserve(chunk::owned_by(self.id).count() * MAX_PDS);
            let bound = self.lock_bound();
            if chunk::owned_by(self.id).count() * MAX_PDS <= withdrawn.capacity() {
                break bound;
            }
        };
        let mut unbound: [Option<Pd>; MAX_PDS] = [const { None }; MAX_PDS];
        for (slot, out) in unbound.iter_mut().enumerate() {
            if !bound.pds[slot].as_ref().is_some_and(|pd| pd.context() == ctx) {
                continue;
            }
            for (_, rec) in chunk::owned_by(self.id) {
                let mr = rec.mrs[slot].swap(std::ptr::null_mut(), Ordering::AcqRel);
                if !mr.is_null() {
                    rec.leaked.store(true, Ordering::Relaxed);
                    self.counters.registered[slot].fetch_sub(rec.len.load(Ordering::Relaxed) as u64, Ordering::Relaxed);
                    withdrawn.push((slot, mr));
                }
            }
            *out = bound.pds[slot].take();
        }
        drop(bound);
        for (slot, pd) in unbound.iter().enumerate() {
            if let Some(pd) = pd {
                // SAFETY: registrations in `pd` just withdrawn from the chunk records (under
                // `bound`), which no longer name them: only the PD deregisters them now.
                unsafe { pd.retire(withdrawn.iter().filter(|(s, _)| *s == slot).map(|&(_, mr)| mr)) };
            }
        }
        let mut watches = self.lock_watches();
        let dropped: Vec<Option<Subscription>> =
            (0..MAX_PDS).filter(|&s| unbound[s].is_some()).map(|s| watches[s].take()).collect();
        drop(watches);
        drop(dropped);
        if unbound.iter().any(Option::is_some) {
            tracing::warn!(
                target: "mralloc::heap",
                heap = self.id,
                device = ctx.name(),
                registrations = withdrawn.len(),
                "the device was removed: the heap withdrew its registrations and is unbound from it"
            );
        }
    }
}
