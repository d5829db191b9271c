//! A striped transfer: pieces cut into slices, posted over the rails, completed once.
//!
//! The transfer owns every piece's buffer until each slice's completion is claimed. Dropped
//! before that, it parks the buffers with every connection that still has a slice of them in
//! flight (one shared holder: the buffers go when the last slice's completion or flush is
//! reaped); forgotten, it leaks them. A slice whose rail failed under it (flushed, retries
//! exhausted, the connection found dead) is posted again on a rail that lives; a slice that
//! failed for its own sake (a refused key or range) fails its piece.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::heap::{lkey_or_register, nodes_of_pages};
use crate::remote::RemoteBuf;
use crate::remote_desc::RemoteDesc;
use crate::transfer::engine::completion::{Completed, Filled, Ticket};
use crate::transfer::rails::finished::{Finished, RailReport};
use crate::transfer::rails::plan::{self, Choice, Cut, Load};
use crate::transfer::rails::{Group, Rails, MAX_RAILS};
use crate::transfer::request::iobuf::Rejected;
use crate::transfer::request::received::Posted;
use crate::transfer::request::{Action, SgeList};
use crate::verbs::{Pd, Sge, WcStatus};

mod wait;

/// How one rail reaches one piece: the local key in its PD, the remote range with the key of
/// the peer's device at its far end.
struct Route {
    lkey: u32,
    remote: RemoteBuf,
}

pub(crate) struct Piece {
    addr: u64,
    len: u64,
    routes: Vec<Option<Route>>,
    /// The piece's NUMA node, when some rail's device has one.
    node: Option<u32>,
    /// Why a rail could not take it (the first such reason), reported if none can.
    refused: Option<Error>,
    error: Option<Error>,
}

/// A slice in flight.
struct Flight {
    ticket: Ticket,
    cut: Cut,
    seq: u64,
    /// When it was posted: its connection's `op_timeout` counts from here.
    posted: Instant,
    /// What it was posted as (its completion is checked against it).
    posted_as: Posted,
}

/// A striped WRITE or READ in flight, owning its buffers ([`Rails::post_write`] and friends).
///
/// [`Striped::wait`] drives it to the end and gives the buffers back. Dropping it stops posting
/// and returns at once: the buffers stay with the connections until every slice in flight has
/// completed or been flushed, then they are freed. `mem::forget` leaks them. The NIC never
/// touches freed memory.
#[must_use = "dropping a Striped stops it; its buffers are freed once the slices in flight complete"]
pub struct Striped<B: Send + 'static> {
    rails: Arc<Group>,
    bufs: Vec<B>,
    read: bool,
    fill: Option<Filled<B>>,
    pieces: Vec<Piece>,
    queue: VecDeque<Cut>,
    flights: Vec<VecDeque<Flight>>,
    reports: Vec<RailReport>,
    seq: u64,
    /// A flush never came (or the process forked): the NIC may use the buffers for ever.
    leak: bool,
}

impl<B: Send + 'static> std::fmt::Debug for Striped<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let flying: usize = self.flights.iter().map(VecDeque::len).sum();
        f.debug_struct("Striped")
            .field("pieces", &self.pieces.len())
            .field("queued", &self.queue.len())
            .field("in_flight", &flying)
            .finish()
    }
}

/// What a failed slice means for its piece.
enum Fate {
    /// Its rail failed under it: post it again elsewhere.
    Repost,
    /// The request itself failed: the piece fails.
    Fail,
    /// Nobody knows when the NIC is done with the memory.
    Leak,
}

/// What `e`, the outcome of the slice posted as work request `wr_id` (`None`: refused when
/// posted), means. A flushed request reports the failure that broke its connection, which may
/// be another request's (`wr_id` says whose): only a request's own failure fails its piece.
fn fate(e: &Error, wr_id: Option<u64>) -> Fate {
    match e {
        Error::FlushLost { .. } | Error::Forked(_) => Fate::Leak,
        Error::Operation { status, wr_id: failed, .. } => match status {
            WcStatus::WrFlushErr | WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr | WcStatus::RespTimeoutErr => {
                Fate::Repost
            }
            _ if Some(*failed) == wr_id => Fate::Fail,
            _ => Fate::Repost,
        },
        _ => Fate::Repost,
    }
}

/// Holds a dropped transfer's buffers until its last parked slice is released.
struct Keep<B>(#[allow(dead_code)] Mutex<Vec<B>>);

/// A parked slice: keeps the buffers, and its bytes on its rail's load until released.
struct ParkedSlice<B> {
    _keep: Arc<Keep<B>>,
    load: Arc<AtomicU64>,
    len: u64,
}

impl<B> Drop for ParkedSlice<B> {
    fn drop(&mut self) {
        self.load.fetch_sub(self.len, Ordering::Relaxed);
    }
}

impl Rails {
    /// A piece of `len` bytes at `addr`, to or from the start of `remote`, with its routes.
    pub(crate) fn piece(&self, addr: u64, len: u64, remote: &RemoteDesc, lkey: impl Fn(&Pd) -> Option<u32>) -> Piece {
        let mut p = Piece { addr, len, routes: Vec::new(), node: None, refused: None, error: None };
        if len == 0 {
            p.error = Some(Error::InvalidArgument("a piece of zero bytes".into()));
            return p;
        }
        if len > remote.len() {
            p.error = Some(Error::OutOfBounds { offset: 0, len, size: remote.len() });
            return p;
        }
        for rail in self.group().rails() {
            let conn = rail.conn();
            // A heap that registers with a device on first use does it here, for each rail the
            // piece may go over.
            let local =
                lkey(conn.pd()).map_or_else(|| lkey_or_register(addr as *const u8, len as usize, conn.pd()), Ok);
            let route = match (local, remote.for_peer(conn.peer())) {
                (Ok(lkey), Ok(remote)) => Some(Route { lkey, remote }),
                (Err(e), _) | (_, Err(e)) => {
                    p.refused.get_or_insert(e);
                    None
                }
            };
            p.routes.push(route);
        }
        if p.routes.iter().all(Option::is_none) {
            p.error = p.refused.take();
        } else if self.options().prefer_local && self.group().rails().iter().any(|r| r.node().is_some()) {
            p.node = nodes_of_pages(&[addr as *const u8]).ok().and_then(|n| u32::try_from(n[0]).ok());
        }
        p
    }
}

impl<B: Send + 'static> Striped<B> {
    pub(crate) fn start(
        rails: &Arc<Group>,
        bufs: Vec<B>,
        pieces: Vec<Piece>,
        read: bool,
        fill: Option<Filled<B>>,
    ) -> Striped<B> {
        let lens: Vec<u64> = pieces.iter().map(|p| if p.error.is_some() { 0 } else { p.len }).collect();
        let reports = rails.blank_reports();
        let mut s = Striped {
            rails: Arc::clone(rails),
            bufs,
            read,
            fill,
            pieces,
            queue: plan::cut(&lens, rails.options().slice as u64),
            flights: rails.rails().iter().map(|_| VecDeque::new()).collect(),
            reports,
            seq: 0,
            leak: false,
        };
        s.post_more();
        s
    }

    /// A one-piece transfer whose piece failed before posting gives its buffer back.
    pub(crate) fn single(mut self) -> std::result::Result<Striped<B>, Rejected<B>> {
        // A piece that failed after some of its slices were posted (its rails died meanwhile)
        // is not refused: the NIC may still use the buffer; `wait` reports the failure.
        if self.flights.iter().all(VecDeque::is_empty) {
            if let Some(error) = self.pieces[0].error.take() {
                return Err(Rejected { error, buf: self.bufs.pop() });
            }
        }
        Ok(self)
    }

    /// Reaps the completions that have arrived and posts what the windows allow; fails a rail
    /// whose oldest slice of this transfer waited longer than its connection's `op_timeout`
    /// (its slices are posted again on the others once flushed). Returns whether the transfer
    /// is over (then [`Striped::wait`] returns at once).
    pub fn progress(&mut self) -> bool {
        if self.forked() {
            return true;
        }
        self.reap_ready();
        self.expire_stalled();
        self.post_more();
        self.is_over()
    }

    /// In a fork()ed child of the process that made the rails: the requests are the parent's
    /// and the connections' locks may be held. Stops the transfer without touching them: the
    /// buffers are kept for good (leaked), every piece not yet done says `Forked`.
    pub(crate) fn forked(&mut self) -> bool {
        if !self.rails.rails().iter().any(|r| r.conn().forked_copy()) {
            return false;
        }
        self.leak = true;
        let flying = self.flights.iter_mut().flat_map(|f| f.drain(..)).map(|f| f.cut);
        let cuts: Vec<Cut> = flying.chain(self.queue.drain(..)).collect();
        for cut in cuts {
            self.pieces[cut.piece].error.get_or_insert(Error::Forked("this rail group"));
        }
        true
    }

    /// Settles every slice whose completion has arrived. Returns whether there was one.
    pub(crate) fn reap_ready(&mut self) -> bool {
        let mut moved = false;
        for r in 0..self.flights.len() {
            while let Some(f) = self.flights[r].front() {
                let conn = self.rails.rails()[r].conn();
                if !matches!(conn.core().is_done(f.ticket), Ok(true)) {
                    break;
                }
                let res = conn.wait(f.ticket);
                self.settle(r, res);
                moved = true;
            }
        }
        moved
    }

    /// Asks every rail to wake `cx` on its next completion (every rail: a later `progress`
    /// may move this transfer's slices to rails that had none, and the send queues may be
    /// full of other requests).
    #[cfg(feature = "tokio")]
    pub(crate) fn wake_on_completion(&self, cx: &std::task::Context<'_>) {
        for rail in self.rails.rails() {
            rail.wake_on_completion(cx);
        }
    }

    pub(crate) fn is_over(&self) -> bool {
        self.queue.is_empty() && self.flights.iter().all(VecDeque::is_empty)
    }

    /// The end of a transfer that is over: the READ targets learn what was written, the
    /// buffers go back (or are leaked).
    pub(crate) fn finish(mut self) -> Finished<B> {
        debug_assert!(self.is_over());
        let mut bufs = std::mem::take(&mut self.bufs);
        let errors: Vec<Option<Error>> = self.pieces.iter_mut().map(|p| p.error.take()).collect();
        if let (Some(fill), true) = (self.fill, !self.leak) {
            for ((buf, piece), e) in bufs.iter_mut().zip(&self.pieces).zip(&errors) {
                if e.is_none() {
                    // SAFETY: every slice of this piece completed successfully: the READ wrote
                    // all `len` bytes of the target from its start.
                    unsafe { fill(buf, piece.len as usize) };
                }
            }
        }
        let bufs = if self.leak {
            std::mem::forget(bufs);
            None
        } else {
            Some(bufs)
        };
        for (report, rail) in self.reports.iter_mut().zip(self.rails.rails()) {
            if report.failure.is_none() {
                report.failure = rail.conn().error();
            }
        }
        Finished::new(bufs, errors, std::mem::take(&mut self.reports))
    }

    /// Posts queued slices while some rail that reaches their piece has room.
    fn post_more(&mut self) {
        let window = self.rails.options().window as u64;
        // Rails whose send queue was found full this round: chosen last, and chosen again means
        // every usable rail is full.
        let mut full = 0u32;
        while let Some(&cut) = self.queue.front() {
            if self.leak {
                // A flush never came: nothing more is posted; what was not sent says so.
                let lost = Error::FlushLost { wr_id: 0, waited: std::time::Duration::ZERO };
                self.pieces[cut.piece].error.get_or_insert(lost);
            }
            if self.pieces[cut.piece].error.is_some() {
                self.queue.pop_front();
                continue;
            }
            let piece = &self.pieces[cut.piece];
            // One per rail, on the stack: this runs for every slice.
            let mut loads = [Load { usable: false, local: false, outstanding: 0 }; MAX_RAILS];
            let rails = self.rails.rails();
            for (i, (r, route)) in rails.iter().zip(&piece.routes).enumerate() {
                loads[i] = Load {
                    usable: route.is_some() && r.alive(),
                    local: piece.node.is_none() || r.node().is_none() || r.node() == piece.node,
                    outstanding: if full & (1 << i) != 0 { u64::MAX } else { r.outstanding() },
                };
            }
            let idle = self.flights.iter().all(VecDeque::is_empty);
            match plan::choose(&loads[..rails.len()], cut.len, window, idle) {
                Choice::Rail(r) if full & (1 << r) != 0 => break,
                Choice::Rail(r) => {
                    self.queue.pop_front();
                    if !self.post(r, cut) {
                        full |= 1 << r;
                    }
                }
                Choice::Full => break,
                Choice::Unreachable => {
                    self.queue.pop_front();
                    let why = self.down(cut.piece);
                    self.pieces[cut.piece].error.get_or_insert(why);
                }
            }
        }
    }

    /// Why no rail can take a piece any more: the refusal if one refused it, else the rails'
    /// failures.
    fn down(&mut self, piece: usize) -> Error {
        if let Some(e) = self.pieces[piece].refused.take() {
            return e;
        }
        let failures = self
            .rails
            .rails()
            .iter()
            .zip(&self.pieces[piece].routes)
            .enumerate()
            .filter(|(_, (_, route))| route.is_some())
            .map(|(i, (r, _))| {
                format!("rail {i} ({}): {}", r.device(), r.conn().error().map_or("failed".into(), |e| e.to_string()))
            })
            .collect();
        Error::RailsDown { failures }
    }

    /// Posts `cut` on rail `r`, never waiting. A rail that refuses the request (its grants,
    /// the range) leaves the piece's routes; a failed post puts the slice back. Returns `false`
    /// if the rail's send queue is full (the slice is put back: post more after a reap).
    fn post(&mut self, r: usize, cut: Cut) -> bool {
        let rail = &self.rails.rails()[r];
        let conn = rail.conn();
        let piece = &self.pieces[cut.piece];
        let route = piece.routes[r].as_ref().expect("a chosen rail reaches the piece");
        // A slice is at most 1 GiB (RailOptions::slice).
        let sge = Sge::new(piece.addr + cut.start, cut.len as u32, route.lkey);
        let action = if self.read {
            Action::Read { remote: &route.remote, offset: cut.start }
        } else {
            Action::Write { remote: &route.remote, offset: cut.start, imm: None }
        };
        let req = match conn.request(action, SgeList::One(sge)) {
            Ok(req) => req,
            Err(e) => {
                let piece = &mut self.pieces[cut.piece];
                piece.routes[r] = None;
                piece.refused.get_or_insert(e);
                self.queue.push_front(cut);
                return true;
            }
        };
        let posted_as = req.posted();
        rail.load().fetch_add(cut.len, Ordering::Relaxed);
        // SAFETY: the memory is the piece's buffer, which this transfer owns until the slice's
        // completion is claimed (`settle`), or parks with this connection (drop), or leaks (a
        // flush that never came).
        match unsafe { rail.try_post(&req) } {
            Ok(Some(ticket)) => {
                self.seq += 1;
                self.flights[r].push_back(Flight { ticket, cut, seq: self.seq, posted: Instant::now(), posted_as });
                true
            }
            Ok(None) => {
                rail.load().fetch_sub(cut.len, Ordering::Relaxed);
                self.queue.push_front(cut);
                false
            }
            Err(e) => {
                rail.load().fetch_sub(cut.len, Ordering::Relaxed);
                // No work request of its own: a failure of the rail (since it was chosen) is
                // not this slice's, and `failed` posts it elsewhere.
                self.failed(r, cut, e, None);
                true
            }
        }
    }

    /// Takes the outcome of rail `r`'s oldest slice in flight.
    fn settle(&mut self, r: usize, res: Result<Completed>) {
        let f = self.flights[r].pop_front().expect("a slice in flight");
        let rail = &self.rails.rails()[r];
        rail.load().fetch_sub(f.cut.len, Ordering::Relaxed);
        // The completion must be the request's kind (a device fault otherwise: the slice's
        // bytes are not taken as moved).
        match res.and_then(|c| c.delivered(f.posted_as)) {
            Ok(_) => {
                rail.moved(f.cut.len);
                self.reports[r].bytes += f.cut.len;
                self.reports[r].slices += 1;
            }
            Err(e) => self.failed(r, f.cut, e, Some(f.ticket.wr_id)),
        }
    }

    /// A slice that failed on rail `r` with `e` (posted as work request `wr_id`): posted
    /// again, or its piece failed. A failed piece's other slices are not posted again (its
    /// refused key or range would break another rail too).
    fn failed(&mut self, r: usize, cut: Cut, e: Error, wr_id: Option<u64>) {
        let conn = self.rails.rails()[r].conn();
        let report = &mut self.reports[r];
        match fate(&e, wr_id) {
            Fate::Repost if self.pieces[cut.piece].error.is_some() => {
                report.failure.get_or_insert_with(|| conn.error().unwrap_or(e));
            }
            Fate::Repost if conn.core().failure().is_some() || conn.forked_copy() => {
                report.failure.get_or_insert_with(|| conn.error().unwrap_or(e));
                report.reposted += 1;
                self.queue.push_front(cut);
            }
            Fate::Repost | Fate::Fail => {
                if let Some(why) = conn.error() {
                    report.failure.get_or_insert(why);
                }
                self.pieces[cut.piece].error.get_or_insert(e);
            }
            Fate::Leak => {
                self.leak = true;
                report.failure.get_or_insert_with(|| conn.error().unwrap_or(Error::Closed));
                self.pieces[cut.piece].error.get_or_insert(e);
            }
        }
    }
}

impl<B: Send + 'static> Drop for Striped<B> {
    fn drop(&mut self) {
        if self.flights.iter().all(VecDeque::is_empty) {
            return;
        }
        let mut bufs = std::mem::take(&mut self.bufs);
        if self.rails.rails().iter().any(|r| r.conn().forked_copy()) {
            // A fork()ed child's copy: the parent's NIC may use the memory, and the
            // connections' locks may be held: keep it for good, touch nothing.
            std::mem::forget(bufs);
            return;
        }
        if self.leak {
            // A flush never came: the NIC may use the memory for ever. The slices still in
            // flight are parked all the same (their tickets abandoned, their bytes taken off
            // their rails' loads when reaped), over no memory.
            std::mem::forget(std::mem::take(&mut bufs));
        }
        let keep = Arc::new(Keep(Mutex::new(bufs)));
        for (r, flights) in self.flights.iter_mut().enumerate() {
            let rail = &self.rails.rails()[r];
            for f in flights.drain(..) {
                let parked = ParkedSlice { _keep: Arc::clone(&keep), load: Arc::clone(rail.load()), len: f.cut.len };
                if rail.conn().core().park(f.ticket, Box::new(parked)) {
                    rail.parked();
                }
            }
        }
    }
}
