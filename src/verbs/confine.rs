//! Whether a device confines a type 2 memory window to the window's own range: probed for real,
//! once per opened device.
//!
//! The specification has the device check every remote access through a window against the
//! window's range. Soft-RoCE (rxe, Linux 6.1) checks only against the region the window is bound
//! to, so there a window over one buffer of a registered heap chunk lets its rkey reach the rest
//! of the chunk. Nothing in the device's attributes tells, so the answer is measured: a loopback
//! RC pair on the device, a window bound over the middle of a small region, and a peer's
//! accesses one byte past and one byte before the window (still inside the region). Refused with
//! a remote access error each time: the device confines windows. An access that succeeds or
//! writes a byte: it does not. Only those two answers are kept; a probe that cannot be set up or
//! run (no window support, the memlock limit, a lost completion) answers "does not confine" for
//! now, and the device is probed again on a later question, at most once per [`RETRY`].
//!
//! The answer only chooses how an exact key is made (`transfer::exact`): a window over the heap
//! chunk's region where windows are confined, else a window over a registration of exactly the
//! buffer. Both are exact; "does not confine" is the safe default.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::verbs::WcStatus;
use crate::verbs::{Access, ConnectOptions, Context, Cq, Mw, Pd, Qp, RegisteredBuf, RemoteAddr, SendOp, SendWr};

/// The answer for one opened device, measured on first use.
#[derive(Default)]
pub(crate) struct Confinement {
    /// The definite answer, once a probe gave one.
    answer: OnceLock<bool>,
    /// Held while probing (one probe at a time); when the last probe failed, if it did. (A std
    /// mutex: the `Context` stays unwind-safe; a probe that panicked leaves no bad state.)
    probing: Mutex<Option<Instant>>,
}

/// How long after a failed probe the device is not probed again ("does not confine" meanwhile).
const RETRY: Duration = Duration::from_secs(60);
/// Size of the probe's region (one page: a registration of its own, never heap memory).
const REGION: usize = 4096;
/// The window: `[WINDOW, 2 * WINDOW)` of the region, with region bytes on both sides.
const WINDOW: usize = 1024;
/// How long one completion of the probe may take (Soft-RoCE under emulation is slow; a device
/// that drops the loopback fails the probe, which then counts as "does not confine").
const WAIT: Duration = Duration::from_secs(5);

/// What one access outside the window did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outside {
    /// Refused with a remote access error, and the region unchanged.
    Refused,
    /// It went through (or changed a byte).
    Reached,
}

/// The accesses outside the window the probe tries, each on a fresh queue-pair pair (a refused
/// one leaves its pair in the error state).
#[derive(Debug, Clone, Copy)]
enum Attempt {
    /// An RDMA WRITE of the byte right after the window.
    WriteAfter,
    /// An RDMA WRITE of the byte right before the window.
    WriteBefore,
    /// An RDMA READ of the byte right after the window.
    ReadAfter,
}

impl Context {
    /// Whether this device checks remote accesses through a type 2 memory window against the
    /// window's own range (as the specification asks), rather than only against the memory
    /// region the window is bound to (as Soft-RoCE in Linux 6.1 does). Measured the first time
    /// it is asked for this opened device — a loopback connection on its first active port and
    /// default GID index, a window bound over part of a small region, RDMA WRITEs one byte past
    /// and one byte before the window and a READ one byte past it, each of which must fail with
    /// a remote access error — and cached with the `Context`. Each attempt sets up a PD, two CQs,
    /// two queue pairs, a window and a one-page region, and releases them: 3-12 ms in the
    /// Soft-RoCE VM, where the first attempt decides; a device that confines runs all three.
    ///
    /// Only a definite answer is cached. A probe that cannot be set up or fails (a device
    /// without memory windows, the memlock limit, a completion that never comes) is logged as a
    /// warning and gives `false`; the device is probed again when asked after a minute. In a
    /// fork()ed child of the process that opened the device this never probes: it gives the
    /// answer known at the fork, else `false`.
    ///
    /// [`crate::transfer::Connection::grant`] and lent remote memory bind their window over the
    /// heap's own region where this is `true`, and over a registration of exactly the granted
    /// bytes elsewhere: exact either way; this only picks the cheaper one.
    pub fn confines_memory_windows(&self) -> bool {
        self.confines_windows_on(None)
    }

    /// What [`Context::confines_memory_windows`] answers now without probing, if it would not
    /// probe (a cached answer; `false` in a fork()ed child or soon after a failed probe).
    #[cfg(feature = "tokio")]
    pub(crate) fn confinement_settled(&self) -> Option<bool> {
        let c = &self.inner.confinement;
        if let Some(&confined) = c.answer.get() {
            return Some(confined);
        }
        if !self.owned_here() {
            return Some(false);
        }
        // Busy (another thread probes): not settled, the caller waits for that probe.
        let failed = match c.probing.try_lock() {
            Ok(g) => *g,
            Err(std::sync::TryLockError::Poisoned(p)) => *p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        failed.is_some_and(|t| t.elapsed() < RETRY).then_some(false)
    }

    /// Decides the answer without probing (tests of the path a device does not take).
    #[cfg(test)]
    pub(crate) fn assume_windows_confined(&self, confined: bool) {
        let _ = self.inner.confinement.answer.set(confined);
        assert_eq!(self.inner.confinement.answer.get(), Some(&confined), "asked before it was set");
    }

    /// [`Context::confines_memory_windows`], probing (if not known yet) on `port` and
    /// `gid_index` — the ones of a connection known to work — or the defaults.
    pub(crate) fn confines_windows_on(&self, at: Option<(u8, u32)>) -> bool {
        let c = &self.inner.confinement;
        if let Some(&confined) = c.answer.get() {
            return confined;
        }
        if !self.owned_here() {
            // A fork()ed child: a parent thread may have been probing (holding the lock) at the
            // fork, and the device is the parent's. Touch neither.
            return false;
        }
        let mut failed = c.probing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&confined) = c.answer.get() {
            return confined; // probed meanwhile by the thread that held the lock
        }
        if failed.is_some_and(|t| t.elapsed() < RETRY) {
            return false;
        }
        let started = Instant::now();
        #[cfg(test)]
        let answer = tests::while_probing().map_or_else(|| probe(self, at), Err);
        #[cfg(not(test))]
        let answer = probe(self, at);
        let us = started.elapsed().as_micros() as u64;
        match answer {
            Ok(confined) => {
                tracing::debug!(device = %self.name(), confined, us, "memory-window confinement probe");
                let _ = c.answer.set(confined);
                *failed = None;
                confined
            }
            Err(e) => {
                tracing::warn!(
                    device = %self.name(), us,
                    "memory-window confinement probe failed ({e}): grants bind their windows over exact \
                     registrations until a probe succeeds (next try in {}s at the earliest)",
                    RETRY.as_secs()
                );
                *failed = Some(Instant::now());
                false
            }
        }
    }
}

/// Runs the probe: `Ok(true)` only if every access outside the window was refused.
fn probe(ctx: &Context, at: Option<(u8, u32)>) -> Result<bool> {
    let (port, gid_index) = match at {
        Some(x) => x,
        None => {
            let port =
                ctx.first_active_port().ok_or_else(|| Error::NoActiveDevice { available: vec![ctx.name().into()] })?;
            (port, ctx.default_gid_index(port)?)
        }
    };
    let pd = Pd::new(ctx)?;
    // Local rights and window binding only, as heap chunks are registered: the window carries
    // the remote rights. The region is dropped last (after every window and queue pair of the
    // attempts), deregistered, and leaked if the device refuses that. (`RegisteredBuf::new`
    // refuses MW_BIND, as its bytes are lent out by reference: here the only peer is the
    // probe's own requester, and the bytes are read only once its requests have completed.)
    let mut region = RegisteredBuf::with_any_access(&pd, REGION, Access::LOCAL_WRITE | Access::MW_BIND)?;
    // Marks that any access getting through changes: the WRITEs' source byte, the bytes right
    // outside the window; the READ's target (3 * WINDOW) stays 0.
    region.fill(0);
    region[0] = 0xA5;
    region[WINDOW - 1] = 0x5A;
    region[2 * WINDOW] = 0x5A;
    for attempt in [Attempt::WriteAfter, Attempt::WriteBefore, Attempt::ReadAfter] {
        if try_outside(&pd, &region, port, gid_index, attempt)? == Outside::Reached {
            return Ok(false);
        }
    }
    Ok(true)
}

/// One attempt on a fresh pair of queue pairs: binds a window over the middle of `region`
/// through the responder, checks a WRITE inside it works, then tries `attempt` outside it.
fn try_outside(pd: &Pd, region: &RegisteredBuf, port: u8, gid_index: u32, attempt: Attempt) -> Result<Outside> {
    let ctx = pd.context();
    let cq_req = Cq::new(ctx, 8)?;
    let cq_resp = Cq::new(ctx, 8)?;
    let build = |cq: &Cq, access| Qp::builder(pd, cq, cq).port(port).gid_index(gid_index).remote_access(access).build();
    let requester = build(&cq_req, Access::NONE)?;
    let responder = build(&cq_resp, Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    // A lost packet on a loopback is not expected: few retries, so a broken probe ends soon.
    let opts = ConnectOptions { retry_cnt: 2, rnr_retry: 2, ..ConnectOptions::default() };
    requester.connect(&responder.endpoint(), &opts)?;
    responder.connect(&requester.endpoint(), &opts)?;
    // Dropped first (locals go in reverse order): a bound window holds a reference to its queue
    // pair, and destroying the queue pair first made rxe (Linux 6.1) wait 50 s for it (measured).
    let mw = Mw::new(pd)?;

    let base = region.mr().addr();
    let rkey = mw.next_rkey();
    let bind = SendOp::BindMw {
        mw: mw.as_raw(),
        rkey,
        mr: region.mr().as_raw(),
        addr: base + WINDOW as u64,
        len: WINDOW as u64,
        access: (Access::REMOTE_WRITE | Access::REMOTE_READ).bits(),
    };
    // SAFETY: a bind names no local memory; the region outlives the window (dropped after it).
    unsafe { responder.post_send(&[SendWr::new(1, &[], bind)])? };
    expect_ok(&cq_resp, "memory window bind")?;

    // Inside the window: must work, else windows do not work here at all.
    let inside = RemoteAddr { addr: base + WINDOW as u64, rkey };
    let source = region.mr().sge(0..1)?;
    // SAFETY: the source byte is in the live region (its lkey), which outlives both queue
    // pairs; the completion is polled below before anything else happens.
    unsafe { requester.post_send(&[SendWr::new(2, &[source], SendOp::Write(inside))])? };
    expect_ok(&cq_req, "RDMA WRITE inside the window")?;

    let (target, op, local) = match attempt {
        Attempt::WriteAfter => (2 * WINDOW, SendOp::Write(inside.offset(WINDOW as u64)), 0),
        Attempt::WriteBefore => (WINDOW - 1, SendOp::Write(inside.offset(u64::MAX)), 0),
        Attempt::ReadAfter => (2 * WINDOW, SendOp::Read(inside.offset(WINDOW as u64)), 3 * WINDOW),
    };
    // Nothing is in flight on the region now (every request so far has completed).
    let snapshot = |r: &RegisteredBuf| (r[target], r[local]);
    let before = snapshot(region);
    let sge = region.mr().sge(local..local + 1)?;
    // SAFETY: as above; a READ writes the one byte at `local` of the live region, and the
    // completion is polled before the region is read again.
    unsafe { requester.post_send(&[SendWr::new(3, &[sge], op)])? };
    let wc = cq_req.next(WAIT)?;
    let after = snapshot(region);
    Ok(match wc.status() {
        WcStatus::RemAccessErr if before == after => Outside::Refused,
        WcStatus::Success | WcStatus::RemAccessErr => Outside::Reached,
        _ => return Err(wc.to_error()),
    })
}

/// Waits for the next completion on `cq` and checks it succeeded.
fn expect_ok(cq: &Cq, what: &str) -> Result<()> {
    let wc = cq.next(WAIT)?;
    if !wc.is_ok() {
        tracing::debug!("confinement probe: {what} failed: {}", wc.to_error());
        return Err(wc.to_error());
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use super::RETRY;
    use crate::error::Error;
    use crate::verbs::Context;

    /// Set while a probe holds the lock (test hook).
    static PROBING: AtomicBool = AtomicBool::new(false);
    /// How long a probe holds the lock before probing (test hook, milliseconds).
    static HOLD_MS: AtomicU64 = AtomicU64::new(0);
    /// The next probe fails without probing (test hook).
    static FAIL_NEXT: AtomicBool = AtomicBool::new(false);
    /// Probes started (real or failed by the hook).
    static PROBES: AtomicU64 = AtomicU64::new(0);

    /// Runs before each probe: `Some` fails it.
    pub(super) fn while_probing() -> Option<Error> {
        PROBES.fetch_add(1, Ordering::Relaxed);
        let hold = HOLD_MS.load(Ordering::Relaxed);
        if hold > 0 {
            PROBING.store(true, Ordering::Release);
            std::thread::sleep(Duration::from_millis(hold));
            PROBING.store(false, Ordering::Release);
        }
        FAIL_NEXT.swap(false, Ordering::AcqRel).then(|| Error::InvalidArgument("a probe failed by the test".into()))
    }

    /// The probe runs to a definite answer on the device (a probe that cannot even be set up
    /// would only ever say "does not confine"), and that answer is cached.
    #[test]
    #[ignore = "needs an RDMA device: run scripts/test"]
    fn device_the_probe_measures_a_definite_answer() {
        let ctx = Context::open_default().expect("an RDMA device");
        let started = Instant::now();
        let answer = super::probe(&ctx, None);
        println!("{}: probe {answer:?} in {:?}", ctx.name(), started.elapsed());
        let confined = answer.expect("a definite answer");
        assert_eq!(ctx.confines_memory_windows(), confined, "the same answer through the cache");
        assert!(ctx.inner.confinement.answer.get() == Some(&confined), "cached");
    }

    /// A failed probe is not cached: "does not confine" until a retry a minute later (no probe
    /// meanwhile), whose definite answer is cached.
    #[test]
    #[ignore = "needs an RDMA device: run scripts/test"]
    fn device_a_failed_probe_is_retried_later_not_cached() {
        let ctx = Context::open_default().expect("an RDMA device");
        FAIL_NEXT.store(true, Ordering::Release);
        let before = PROBES.load(Ordering::Relaxed);
        assert!(!ctx.confines_memory_windows(), "a failed probe: does not confine");
        assert_eq!(PROBES.load(Ordering::Relaxed), before + 1);
        assert!(ctx.inner.confinement.answer.get().is_none(), "not cached");
        // Within the minute: no new probe.
        assert!(!ctx.confines_memory_windows());
        assert_eq!(PROBES.load(Ordering::Relaxed), before + 1, "no probe within the minute");
        // A minute later (the failure's time moved back): probed again, and cached.
        let mut failed = ctx.inner.confinement.probing.lock().unwrap();
        assert!(failed.is_some(), "the failure's time is kept");
        *failed = Instant::now().checked_sub(RETRY);
        drop(failed);
        let confined = ctx.confines_memory_windows();
        assert_eq!(PROBES.load(Ordering::Relaxed), before + 2, "probed again");
        assert!(ctx.inner.confinement.answer.get() == Some(&confined), "the retry's answer is cached");
        assert!(ctx.inner.confinement.probing.lock().unwrap().is_none(), "no failure kept");
    }

    /// fork() while another thread probes the device: the child's question returns at once
    /// (`false`: no answer was known at the fork) instead of waiting for a probe that never
    /// ends in the child (before: `OnceLock::get_or_init`, whose initialising thread the child
    /// does not have).
    #[test]
    #[ignore = "needs an RDMA device: run scripts/test"]
    fn device_a_forked_child_asking_during_a_probe_does_not_wait() {
        let ctx = Context::open_default().expect("an RDMA device"); // not probed yet
        HOLD_MS.store(500, Ordering::Relaxed);
        let prober = std::thread::spawn({
            let ctx = ctx.clone();
            move || ctx.confines_memory_windows()
        });
        while !PROBING.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_micros(100));
        }
        HOLD_MS.store(0, Ordering::Relaxed);
        let forked = Instant::now();
        // SAFETY: the child only asks the context and _exits, never returning into libtest.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let confined = std::panic::catch_unwind(|| ctx.confines_memory_windows());
            // SAFETY: leaves the child at once.
            unsafe { libc::_exit(confined.map_or(99, |c| 10 + i32::from(c))) };
        }
        let during = PROBING.load(Ordering::Acquire);
        let mut status = 0;
        let child = loop {
            // SAFETY: pid is our child.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                break forked.elapsed();
            }
            if forked.elapsed() > Duration::from_secs(10) {
                // SAFETY: our child, killed and reaped.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                panic!("the forked child waited for its parent's probe");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let confined = prober.join().unwrap();
        println!("the child answered in {child:?}; the parent's probe said {confined}");
        assert!(during, "the fork came during the probe");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 10, "child status {status:#x}");
        // The parent's answer is cached as usual.
        assert!(ctx.inner.confinement.answer.get() == Some(&confined), "cached");
    }
}
