//! The process's one liveness thread (`mralloc-liveness`): it watches RDMA devices for removal
//! (the [`removal`](crate::verbs::removal) monitor) and, once the transfer layer watches
//! connections, runs that watcher too ([`Watch`]: the TCP streams and RDMA CM channels
//! connections were set up over, devices' async events, keepalive probes) — one `poll(2)` over
//! every descriptor, started once, whichever needs it first.
//!
//! It also runs work a higher layer leaves for it ([`defer`]): the scoped heap's teardown of a
//! heap dropped while buffers of it lived, when the free of the last one could not do it.
//! Such work runs at the thread's next round, then again after pauses growing from
//! [`FIRST_PAUSE`] to [`MOST_PAUSE`], until it says there is nothing left.
//!
//! A fork()ed child starts its own (the parent's thread is not in it).

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::time::{Duration, Instant};

/// What the liveness thread is started for: the device monitor (see
/// [`crate::verbs::removal`]), which also wakes it.
pub(crate) trait Host: Sync {
    /// Its descriptors: the thread's wake-up first.
    fn fds(&self) -> [libc::pollfd; 2];
    /// How long the thread may sleep before the host's periodic work is due (ms, >= 1).
    fn timeout_ms(&self) -> i32;
    /// After every poll (a timeout included), with what the poll found on its descriptors.
    fn after_poll(&self, fds: &[libc::pollfd]);
    /// Wakes the thread (it rebuilds its set of descriptors).
    fn notify(&self);
    /// The process that started it.
    fn pid(&self) -> u32;
}

/// What a higher layer watches on the liveness thread. Called on that thread only.
pub(crate) trait Watch: Sync {
    /// The process that registered it (a fork()ed child's thread ignores its parent's).
    fn pid(&self) -> u32;
    /// Appends the descriptors to poll this round.
    fn add_fds(&self, fds: &mut Vec<libc::pollfd>);
    /// Work due before sleeping (keepalive probes), run after a first look at the descriptors;
    /// returns how long the thread may then sleep (ms, -1: no limit of its own).
    fn due(&self) -> i32;
    /// Whether [`Watch::due`] has anything to do (else the thread sleeps on the descriptors at
    /// once).
    fn has_due(&self) -> bool;
    /// Handles what the poll found on the descriptors it added (in order); returns whether its
    /// set of descriptors changed (rebuilt before sleeping again).
    fn handle(&self, fds: &[libc::pollfd]) -> bool;
}

/// The watch the transfer layer registered (a `&'static dyn Watch`, boxed once and leaked).
static WATCH: AtomicPtr<&'static dyn Watch> = AtomicPtr::new(std::ptr::null_mut());

/// The host the thread was started for (boxed once per process and leaked).
static HOST: AtomicPtr<&'static dyn Host> = AtomicPtr::new(std::ptr::null_mut());

/// Has the liveness thread — already started by the device monitor, which the caller made sure
/// of ([`crate::verbs::removal`]'s `monitor`) — run `w` too, from its next round on.
pub(crate) fn serve(w: &'static dyn Watch) {
    WATCH.store(Box::into_raw(Box::new(w)), Ordering::Release);
    if let Some(host) = host() {
        host.notify();
    }
}

/// This process's host, once its thread is started.
fn host() -> Option<&'static dyn Host> {
    // SAFETY: a non-null pointer came from Box::into_raw and is never freed.
    let h = *unsafe { HOST.load(Ordering::Acquire).as_ref() }?;
    (h.pid() == std::process::id()).then_some(h)
}

/// The deferred work (a `fn() -> bool`, see [`defer`]), or null.
static DEFERRED: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());
/// Set by [`defer`]: run the deferred work at the next round, and soon after.
static KICKED: AtomicBool = AtomicBool::new(false);

/// The pause before deferred work runs again after a run that left some.
pub(crate) const FIRST_PAUSE: Duration = Duration::from_millis(1);
/// What that pause grows to (doubling after each such run), and stays at.
pub(crate) const MOST_PAUSE: Duration = Duration::from_secs(1);

/// Has the liveness thread run `work` at its next round (it is woken for it), then again after
/// pauses growing from [`FIRST_PAUSE`] to [`MOST_PAUSE`] for as long as it returns `true`
/// (there is work left); a later call starts over at the next round. `work` runs on the
/// liveness thread, between its polls; it must not block for long (device removals and
/// keepalive probes wait for it).
///
/// One registrant (the scoped heap's draining list): `work` is the same every call, and a
/// different one would replace it. The thread must be started (the device monitor starts it,
/// `crate::verbs::removal::monitor`); until it is, nothing runs. No allocation and no lock:
/// callable wherever the caller may not do the work itself.
pub(crate) fn defer(work: fn() -> bool) {
    DEFERRED.store(work as *mut (), Ordering::Release);
    KICKED.store(true, Ordering::Release);
    if let Some(host) = host() {
        host.notify();
    }
}

/// The liveness thread's schedule of the deferred work.
struct Deferred {
    /// The pause after the next run that leaves work; `None`: nothing is pending.
    pause: Option<Duration>,
    /// When the work is due.
    due: Instant,
}

impl Deferred {
    /// Runs the deferred work if it is due; returns how long the thread may sleep before it is
    /// due again (ms, at least 1; -1: nothing pending).
    fn run(&mut self) -> i32 {
        let now = Instant::now();
        if KICKED.swap(false, Ordering::AcqRel) {
            (self.pause, self.due) = (Some(FIRST_PAUSE), now);
        }
        let Some(pause) = self.pause else { return -1 };
        if now >= self.due {
            let work = DEFERRED.load(Ordering::Acquire);
            if work.is_null() {
                self.pause = None;
                return -1;
            }
            // SAFETY: a non-null value was stored by `defer`, from a `fn() -> bool`.
            let work: fn() -> bool = unsafe { std::mem::transmute::<*mut (), fn() -> bool>(work) };
            // A panicking run (a tracing subscriber, say) counts as work left.
            if !std::panic::catch_unwind(work).unwrap_or(true) {
                self.pause = None;
                return -1;
            }
            (self.pause, self.due) = (Some((pause * 2).min(MOST_PAUSE)), now + pause);
        }
        self.due.saturating_duration_since(Instant::now()).as_millis().clamp(1, i32::MAX as u128) as i32
    }
}

fn registered() -> Option<&'static dyn Watch> {
    // SAFETY: a non-null pointer came from Box::into_raw and is never freed.
    let w = *unsafe { WATCH.load(Ordering::Acquire).as_ref() }?;
    (w.pid() == std::process::id()).then_some(w)
}

/// Starts the thread for `host` (once per process: the monitor's start-up serialises it).
pub(crate) fn start(host: &'static dyn Host) -> std::io::Result<()> {
    HOST.store(Box::into_raw(Box::new(host)), Ordering::Release);
    std::thread::Builder::new().name("mralloc-liveness".into()).spawn(move || run(host)).map(|_| ())
}

fn run(m: &'static dyn Host) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    // Rounds that skipped the due work because a set of descriptors changed.
    let mut skipped = 0u32;
    let mut deferred = Deferred { pause: None, due: Instant::now() };
    loop {
        // Nothing may end this thread (a panicking tracing subscriber, say): every device and
        // connection of the process depends on it. A round that panicked is logged, and the
        // next one begins after a pause.
        let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let next = deferred.run();
            round(m, &mut fds, &mut skipped, next)
        }));
        if let Err(payload) = round {
            std::mem::forget(payload);
            let _ = std::panic::catch_unwind(|| tracing::error!("the liveness thread panicked; it goes on"));
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

/// One round: the descriptors built afresh, due work run, one sleep (at most `deferred` ms, if
/// not -1: when the deferred work is due again).
fn round(m: &'static dyn Host, fds: &mut Vec<libc::pollfd>, skipped: &mut u32, deferred: i32) {
    fds.clear();
    fds.extend(m.fds());
    let w = registered();
    if let Some(w) = w {
        w.add_fds(fds);
    }
    let mut limit = -1;
    if let Some(w) = w.filter(|w| w.has_due()) {
        // What the devices or the peers said comes before the probes: a QP the device failed
        // flushes the probe too, and the event tells why. A changed set of descriptors is
        // built again before sleeping on it — but a stream of changes does not keep the due
        // work waiting for more than a few rounds.
        if poll_and_handle(m, Some(w), fds, 0) && *skipped < 4 {
            *skipped += 1;
            return;
        }
        *skipped = 0;
        limit = w.due();
    }
    // After the due work (it may take a while): the monitor's own schedule, as it is now.
    let timeout = [limit, deferred].into_iter().filter(|&l| l >= 0).fold(m.timeout_ms(), i32::min);
    poll_and_handle(m, w, fds, timeout);
}

/// Polls `fds` (at most `timeout` ms) and has the monitor and the watch handle what it found;
/// returns whether a set of descriptors changed.
fn poll_and_handle(m: &dyn Host, w: Option<&'static dyn Watch>, fds: &mut [libc::pollfd], timeout: i32) -> bool {
    // SAFETY: fds is a valid array of pollfd. A descriptor closed meanwhile reports POLLNVAL; one
    // reused by another file reports whatever it reports: the handlers look their keys up again
    // before reading anything.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tracing::error!("the liveness thread's poll failed: {e}");
            }));
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        // The watch's descriptors can make every poll fail (more than RLIMIT_NOFILE of them,
        // ENOMEM): the monitor's schedule runs regardless.
        for p in fds.iter_mut() {
            p.revents = 0;
        }
        m.after_poll(&fds[..2]);
        return false;
    }
    let (mine, theirs) = fds.split_at(2);
    // The monitor's periodic check is due on a timeout too.
    m.after_poll(mine);
    // Readable, not merely reported (POLLNVAL on a descriptor closed under us would spin).
    let woken = mine[0].revents & libc::POLLIN != 0;
    match w {
        Some(w) if rc > 0 => w.handle(theirs) || woken,
        _ => woken,
    }
}
