//! The front cache's exchange with the heap's depot ([`crate::heap::depot`]): a full magazine
//! that cannot grow hands its older half over as a batch ([`Front::halve`]), an empty one
//! takes a batch whole ([`Front::refill`], [`Front::adopt`]). Both run under [`Busy`], and
//! call the global allocator or jemalloc only with every magazine whole.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use super::{cap_of, Busy, Front, RECLAIM_BACKOFF, SLOT};
use crate::heap::classes::Class;
use crate::heap::depot::Batch;

impl Front {
    /// Hands the older half of `class`'s full magazine that cannot grow (the bottom of the stack)
    /// to the heap's depot, for a thread whose magazine runs empty, or back to jemalloc if the
    /// depot is full or the batch's memory cannot be had; keeps the recently freed. Under
    /// [`Busy`].
    pub(super) fn halve(&self, class: Class) {
        let (m, depot) = (self.mag(class), self.depot());
        let out = (m.cap.get() as usize).div_ceil(2);
        // The batch is made before the magazine changes: making it may re-enter the heap.
        let batch = if depot.reserve(class, out) {
            let b = Batch::with_capacity(out);
            if b.is_none() {
                depot.unreserve(class, out);
            }
            b
        } else {
            None
        };
        let len = m.len.load(Ordering::Relaxed) as usize;
        if len < m.cap.get() as usize {
            // Re-entered allocations took some: there is room again.
            if batch.is_some() {
                depot.unreserve(class, out);
            }
            return;
        }
        let keep = len - out;
        // SAFETY: items[..len] are initialised objects of the magazine, and no other reference
        // to its slots exists (only this thread touches them; nothing below re-enters the heap
        // until the victims are copied out).
        let slots = unsafe { std::slice::from_raw_parts_mut(m.items.get(), len) };
        // The newer `keep` objects to the bottom, the older `out` above them.
        slots.rotate_left(out);
        match batch {
            Some(mut batch) => {
                // Within the batch's capacity: no allocation.
                batch.items.extend_from_slice(&slots[keep..]);
                m.len.store(keep as u32, Ordering::Relaxed);
                depot.shelve(class, batch);
            }
            None => {
                // The magazine is settled before jemalloc runs: the victims lie above its length,
                // and above its room for as long as they are freed.
                let most = m.cap.replace(keep as u32);
                m.len.store(keep as u32, Ordering::Relaxed);
                self.free_all(&slots[keep..], class.size());
                m.cap.set(most);
            }
        }
    }

    /// [`Front::take`] found `class`'s magazine empty: it takes a batch from the heap's depot
    /// (objects another thread's front gave up) and one object of it, if the depot has one and
    /// the thread's budget pays for it; else the caller goes to jemalloc.
    #[cold]
    #[inline(never)]
    pub(crate) fn refill(&self, class: Class) -> Option<NonNull<u8>> {
        if self.refill_backoff.get() > 0 {
            self.refill_backoff.set(self.refill_backoff.get() - 1);
            return None;
        }
        let _busy = Busy::enter(self)?;
        let batch = self.depot().take(class)?;
        if let Err(batch) = self.adopt(class, batch) {
            // The budget cannot pay for it: back to the depot for another thread, and this
            // thread asks jemalloc for a while before trying again.
            self.depot().put_back(class, batch);
            self.refill_backoff.set(RECLAIM_BACKOFF);
            return None;
        }
        self.take(class)
    }

    /// Fills `class`'s empty magazine with `batch` (taking over its storage if the magazine's
    /// is too small), charging the room to the budget (taking back room other classes do not
    /// use if needed); `Err` gives the batch back if the budget cannot pay. Under [`Busy`].
    fn adopt(&self, class: Class, mut batch: Box<Batch>) -> Result<(), Box<Batch>> {
        let (m, size, room_cell) = (self.mag(class), class.size(), &self.room[class.index()]);
        let n = batch.items.len();
        let plan = || {
            let (cap, room) = (m.cap.get() as usize, room_cell.get() as usize);
            // Its own storage if it has room, else the batch's.
            let new_room = if room >= n { room } else { batch.items.capacity() };
            let new_cap = cap.max(n);
            // What this class reserves (`cap` objects, `room` slots) is replaced.
            let reserved = self.reserved.get() - cap * size - room * SLOT + new_cap * size + new_room * SLOT;
            (new_cap, new_room, reserved)
        };
        let (mut cap, mut room, mut reserved) = plan();
        if reserved > self.limit {
            self.reclaim();
            (cap, room, reserved) = plan();
            if reserved > self.limit {
                return Err(batch);
            }
        }
        // Nothing above re-entered the heap after the plan (reclaim's did, before it): the
        // magazine is as planned, and empty (the caller's `take` found it so, and only a
        // re-entered free could have filled it, which reclaim's flush of nothing allows).
        let len = m.len.load(Ordering::Relaxed) as usize;
        if len != 0 {
            return Err(batch);
        }
        let old_slots = if room == room_cell.get() as usize {
            // SAFETY: the magazine's storage has room >= n slots; the batch is a different
            // allocation.
            unsafe { std::ptr::copy_nonoverlapping(batch.items.as_ptr(), m.items.get(), n) };
            Vec::new()
        } else {
            self.swap_storage(class, std::mem::take(&mut batch.items))
        };
        m.cap.set(cap as u32);
        self.reserved.set(reserved);
        m.len.store(n as u32, Ordering::Relaxed);
        debug_assert!(self.reserved.get() <= self.limit && cap <= room && cap <= cap_of(size));
        // Freed last, with the magazine whole again (a free may re-enter the heap).
        drop(old_slots);
        drop(batch);
        Ok(())
    }
}
