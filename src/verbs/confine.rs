//! Whether a device confines a type 2 memory window to the window's own range: probed for real,
//! once per opened device.
//!
//! The specification has the device check every remote access through a window against the
//! window's range. Soft-RoCE (rxe, Linux 6.1) checks only against the region the window is bound
//! to, so there a window over one buffer of a registered heap chunk lets its rkey reach the rest
//! of the chunk. Nothing in the device's attributes tells, so the answer is measured: a loopback
//! RC pair on the device, a window bound over the middle of a small region, and a peer's
//! accesses one byte past and one byte before the window (still inside the region). Refused with
//! a remote access error each time: the device confines windows. Anything else — an access that
//! succeeds or writes a byte, no window support, a probe that cannot be set up — counts as "does
//! not confine", so callers that depend on confinement take their other path.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::verbs::WcStatus;
use crate::verbs::{Access, ConnectOptions, Context, Cq, Mw, Pd, Qp, RegisteredBuf, RemoteAddr, SendOp, SendWr};

/// The answer for one opened device, measured on first use.
#[derive(Default)]
pub(crate) struct Confinement(OnceLock<bool>);

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
    /// two queue pairs, a window and a one-page region, and releases them: 3-25 ms in the
    /// Soft-RoCE VM, where the first attempt decides; a device that confines runs all three. A
    /// device without memory windows, or a probe that cannot be set up (e.g. past the memlock
    /// limit), gives `false`, and is not probed again through this `Context`.
    ///
    /// [`crate::transfer::Connection::grant`] and lent remote memory use windows only where this
    /// is `true`, and a registration of exactly the granted bytes elsewhere.
    pub fn confines_memory_windows(&self) -> bool {
        self.confines_windows_on(None)
    }

    /// Whether [`Context::confines_memory_windows`] is known already (asking costs nothing).
    #[cfg(feature = "tokio")]
    pub(crate) fn confinement_known(&self) -> bool {
        self.inner.confinement.0.get().is_some()
    }

    /// Decides the answer without probing (tests of the path a device does not take).
    #[cfg(test)]
    pub(crate) fn assume_windows_confined(&self, confined: bool) {
        let _ = self.inner.confinement.0.set(confined);
        assert_eq!(self.inner.confinement.0.get(), Some(&confined), "asked before it was set");
    }

    /// [`Context::confines_memory_windows`], probing (if not known yet) on `port` and
    /// `gid_index` — the ones of a connection known to work — or the defaults.
    pub(crate) fn confines_windows_on(&self, at: Option<(u8, u32)>) -> bool {
        *self.inner.confinement.0.get_or_init(|| {
            let started = Instant::now();
            let answer = probe(self, at);
            let us = started.elapsed().as_micros() as u64;
            match &answer {
                Ok(confined) => tracing::debug!(device = %self.name(), confined, us, "memory-window confinement probe"),
                Err(e) => tracing::info!(
                    device = %self.name(), us,
                    "memory-window confinement probe failed ({e}): grants use exact registrations on this device"
                ),
            }
            answer.unwrap_or(false)
        })
    }
}

/// Runs the probe: `Ok(true)` only if every access outside the window was refused.
fn probe(ctx: &Context, at: Option<(u8, u32)>) -> Result<bool> {
    let (port, gid_index) = match at {
        Some(x) => x,
        None => {
            let port = ctx.first_active_port().ok_or(Error::NoActiveDevice { available: vec![ctx.name().into()] })?;
            (port, ctx.default_gid_index(port)?)
        }
    };
    let pd = Pd::new(ctx)?;
    // Local rights and window binding only, as heap chunks are registered: the window carries
    // the remote rights. The region is dropped last (after every window and queue pair of the
    // attempts), deregistered, and leaked if the device refuses that.
    let mut region = RegisteredBuf::new(&pd, REGION, Access::LOCAL_WRITE | Access::MW_BIND)?;
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
