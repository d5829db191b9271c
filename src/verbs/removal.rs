//! Device removal: `rdma link delete`, a driver unbound, a NIC unplugged.
//!
//! What the kernel does: the device's uverbs character device (`/dev/infiniband/uverbsN`)
//! disappears first; RDMA CM ids on it get `DEVICE_REMOVAL`; then the removal waits for the
//! processes using it. A provider that can cut a process off (`disassociate_ucontext`: mlx5,
//! for one) does so at once and reports `IBV_EVENT_DEVICE_FATAL`; one that cannot (rxe, siw)
//! makes the removal wait until every process has closed the device — destroyed its QPs, CQs,
//! memory registrations and PDs and closed its contexts. Until then such a device keeps
//! working, so nothing fails by itself.
//!
//! How mralloc finds out: the process's one liveness thread ([`crate::verbs::liveness`], started with the first
//! connection, shared receive queue or bound heap) listens to the kernel's device events (a
//! `NETLINK_KOBJECT_UEVENT` socket) and, when a uverbs device goes, checks every context it
//! watches; it also checks every 5 s (every second without that socket: some containers), and
//! once when a context is first watched. A context is removed when its device's sysfs entry
//! (`/sys/class/infiniband_verbs/uverbsN`) is gone or is another one (a new inode: the device
//! was re-added), or when the device node it has open was unlinked (`st_nlink` 0). A CM
//! `DEVICE_REMOVAL` or an async `DEVICE_FATAL` read elsewhere declares the removal too
//! ([`declare`]).
//!
//! What follows: the context is marked ([`Context::is_removed`]); new objects on it fail with
//! [`Error::DeviceRemoved`]; every subscriber is called on that thread — connections fail with
//! [`crate::Disconnect::DeviceRemoved`], heaps drop their registrations with the device's PDs —
//! and librdmacm is told to close its own context of the device (see [`set_after_removal`]).

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::fork::ForkLock;
use crate::os::Bell;
use crate::verbs::context::ContextInner;
use crate::verbs::liveness::Host;
use crate::verbs::Context;

/// Called once for a removed context.
pub(crate) type Callback = Arc<dyn Fn(&Context) + Send + Sync>;

/// Removals seen by this process (for librdmacm's bookkeeping, see [`set_after_removal`]).
static REMOVALS: AtomicU64 = AtomicU64::new(0);

/// Run after each removal (by the transfer layer, once RDMA CM is in use).
static AFTER_REMOVAL: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Has `f` run on the liveness thread after each removal's subscribers.
pub(crate) fn set_after_removal(f: fn()) {
    AFTER_REMOVAL.store(f as *mut (), Ordering::Release);
}

/// How many device removals this process has seen.
pub(crate) fn removals() -> u64 {
    REMOVALS.load(Ordering::Relaxed)
}

/// Keeps a callback subscribed; dropping it unsubscribes.
pub(crate) struct Subscription {
    monitor: &'static Monitor,
    token: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // A fork()ed child's copy: the parent's monitor has no thread here (and its lock may
        // have been held at the fork).
        if self.monitor.pid == std::process::id() {
            self.monitor.state.lock().subs.remove(&self.token);
        }
    }
}

/// Calls `f` (on the liveness thread) when `ctx`'s device is found removed; soon after (from
/// the liveness thread) if it is already — also if it went before anything watched it.
///
/// # Errors
/// [`Error::Io`] if the liveness thread cannot be started.
pub(crate) fn subscribe(ctx: &Context, f: Callback) -> Result<Subscription> {
    let monitor = monitor()?;
    // Against what was there when the device was opened: also finds a removal before anything
    // watched the context.
    let gone = ctx.inner.node.gone(ctx);
    let token = {
        let mut st = monitor.state.lock();
        st.next += 1;
        let token = st.next;
        st.subs.insert(token, Sub { ctx: Arc::downgrade(&ctx.inner), f });
        token
    };
    if gone {
        mark(&ctx.inner);
    }
    if ctx.is_removed() {
        monitor.pending.lock().push(Arc::downgrade(&ctx.inner));
        monitor.notify();
    }
    Ok(Subscription { monitor, token })
}

/// Has the monitor watch `ctx` (for [`Context::is_removed`]) with nothing to call.
///
/// # Errors
/// As [`subscribe`].
pub(crate) fn watch(ctx: &Context) -> Result<Subscription> {
    subscribe(ctx, Arc::new(|_: &Context| {}))
}

/// Something else showed `ctx`'s device gone (a CM `DEVICE_REMOVAL`, an async
/// `DEVICE_FATAL`): marks it and has the monitor call its subscribers. Never blocks on them
/// (the caller may hold locks a subscriber takes).
pub(crate) fn declare(ctx: &Context) {
    if !mark(&ctx.inner) {
        return;
    }
    if let Ok(m) = monitor() {
        m.pending.lock().push(Arc::downgrade(&ctx.inner));
        m.notify();
    }
}

/// Whether `ctx`'s device is removed, or found gone now (its sysfs entry or device node): for
/// a finding that may be the removal's side effect (an RDMA CM `DISCONNECTED` the removal
/// caused, read before the id's `DEVICE_REMOVAL`). A device found gone is declared removed.
pub(crate) fn removed_now(ctx: &Context) -> bool {
    if ctx.is_removed() {
        return true;
    }
    let gone = ctx.inner.node.gone(ctx);
    if gone {
        declare(ctx);
    }
    gone
}

/// Marks a context removed; `true` if this call did.
fn mark(inner: &ContextInner) -> bool {
    if inner.removed.swap(true, Ordering::AcqRel) {
        return false;
    }
    REMOVALS.fetch_add(1, Ordering::Relaxed);
    // A panicking tracing subscriber must not cost the subscribers their call.
    let _ = std::panic::catch_unwind(|| tracing::warn!(device = %inner.name, "the RDMA device was removed"));
    true
}

/// Whether the device of a context librdmacm opened (not one mralloc watches) is gone now:
/// its sysfs entry is missing or its device node was unlinked.
///
/// # Safety
/// `ctx` is NULL or a live context.
pub(crate) unsafe fn raw_context_gone(ctx: *mut rdma_sys::ibv_context) -> bool {
    if ctx.is_null() {
        return false;
    }
    // SAFETY: the caller's live context.
    let (sysfs, fd) = unsafe { files_of(ctx) };
    matches!(std::fs::symlink_metadata(sysfs), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        || fstat(fd).is_some_and(|st| st.st_nlink == 0)
}

/// A context's sysfs entry (`/sys/class/infiniband_verbs/uverbsN`) and command descriptor.
///
/// # Safety
/// `ctx` is a live context.
unsafe fn files_of(ctx: *mut rdma_sys::ibv_context) -> (std::path::PathBuf, RawFd) {
    // SAFETY: a live context (the caller's promise); dev_name is a NUL-terminated array in its
    // device.
    let (name, fd) = unsafe { (std::ffi::CStr::from_ptr((*(*ctx).device).dev_name.as_ptr()), (*ctx).cmd_fd) };
    (std::path::Path::new("/sys/class/infiniband_verbs").join(&*name.to_string_lossy()), fd)
}

struct Sub {
    ctx: Weak<ContextInner>,
    f: Callback,
}

/// How to tell later whether a context's device still exists, taken when it is opened. Only
/// what was there then counts: a device opened through a node of its own (rdma-core can make
/// one) or without a visible sysfs entry is not taken for removed.
pub(crate) struct Node {
    /// `/sys/class/infiniband_verbs/uverbsN`.
    sysfs: std::path::PathBuf,
    /// That entry's inode when watching began (a re-added device gets a new one); `None` if it
    /// could not be read then.
    sysfs_ino: Option<u64>,
    /// Whether the device node the context has open was linked when watching began (devtmpfs
    /// unlinks it when the device goes).
    linked: bool,
}

impl Node {
    /// # Safety
    /// `ctx` is a live context.
    pub(crate) unsafe fn of_raw(ctx: *mut rdma_sys::ibv_context) -> Node {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: a live context (the caller's promise).
        let (sysfs, fd) = unsafe { files_of(ctx) };
        let sysfs_ino = std::fs::symlink_metadata(&sysfs).ok().map(|m| m.ino());
        Node { sysfs, sysfs_ino, linked: fstat(fd).is_some_and(|st| st.st_nlink > 0) }
    }

    /// Whether the device is gone: its sysfs entry is missing or another one, or its node was
    /// unlinked. Errors other than "not found" count as present.
    fn gone(&self, ctx: &Context) -> bool {
        use std::os::unix::fs::MetadataExt;
        let sysfs_gone = self.sysfs_ino.is_some_and(|ino| match std::fs::symlink_metadata(&self.sysfs) {
            Ok(m) => m.ino() != ino,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        });
        sysfs_gone || (self.linked && fstat(cmd_fd(ctx)).is_some_and(|st| st.st_nlink == 0))
    }
}

fn cmd_fd(ctx: &Context) -> RawFd {
    // SAFETY: a live context (the caller holds it); cmd_fd stays open while it lives.
    unsafe { (*ctx.as_raw()).cmd_fd }
}

fn fstat(fd: RawFd) -> Option<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat on a descriptor the caller's context owns; st is an out-parameter.
    (unsafe { libc::fstat(fd, st.as_mut_ptr()) } == 0).then(|| {
        // SAFETY: filled in by fstat.
        unsafe { st.assume_init() }
    })
}

#[derive(Default)]
struct State {
    next: u64,
    subs: HashMap<u64, Sub>,
}

/// The device monitor: passive state the liveness thread ([`crate::verbs::liveness`]) polls
/// and runs.
pub(crate) struct Monitor {
    state: Mutex<State>,
    /// Contexts declared removed, for the thread to call their subscribers.
    pending: Mutex<Vec<Weak<ContextInner>>>,
    /// Rung when `pending` grows, or when the liveness thread must rebuild its set of
    /// descriptors.
    wake: Bell,
    /// The kernel's device events, if the socket could be opened.
    uevents: Option<RawFd>,
    /// The periodic check: every 5 s (every second without the uevent socket), on time however
    /// many wake-ups come between.
    period: Duration,
    last_check: Mutex<std::time::Instant>,
    pid: u32,
}

static START: ForkLock<()> = ForkLock::new(());
static MONITOR: AtomicPtr<Monitor> = AtomicPtr::new(std::ptr::null_mut());

pub(crate) fn current() -> Option<&'static Monitor> {
    // SAFETY: a non-null pointer came from Box::leak and is never freed.
    let m = unsafe { MONITOR.load(Ordering::Acquire).as_ref() }?;
    (m.pid == std::process::id()).then_some(m)
}

/// This process's monitor, started (with the liveness thread) if need be.
///
/// # Errors
/// [`Error::Io`] if its eventfd or the liveness thread cannot be created.
pub(crate) fn monitor() -> Result<&'static Monitor> {
    if let Some(m) = current() {
        return Ok(m);
    }
    let _g = START.lock();
    if let Some(m) = current() {
        return Ok(m);
    }
    let io = |what: &'static str| move |source| Error::Io { what: what.into(), source };
    let wake = Bell::new("the liveness thread's eventfd")?;
    let uevents = uevent_socket();
    if uevents.is_none() {
        tracing::info!("no kernel uevent socket: checking for removed RDMA devices once a second");
    }
    let m: &'static Monitor = Box::leak(Box::new(Monitor {
        state: Mutex::new(State::default()),
        pending: Mutex::new(Vec::new()),
        wake,
        uevents,
        period: Duration::from_millis(if uevents.is_some() { 5000 } else { 1000 }),
        last_check: Mutex::new(std::time::Instant::now()),
        pid: std::process::id(),
    }));
    crate::verbs::liveness::start(m).map_err(io("starting the liveness thread"))?;
    MONITOR.store(std::ptr::from_ref(m).cast_mut(), Ordering::Release);
    Ok(m)
}

/// A socket receiving the kernel's device events (uevents), or `None`.
fn uevent_socket() -> Option<RawFd> {
    // SAFETY: plain syscalls on a socket this function owns.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            libc::NETLINK_KOBJECT_UEVENT,
        );
        if fd < 0 {
            return None;
        }
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        sa.nl_groups = 1; // the kernel's own events
        let len = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
        if libc::bind(fd, std::ptr::addr_of!(sa).cast(), len) != 0 {
            libc::close(fd);
            return None;
        }
        Some(fd)
    }
}

/// Whether a uevent (`ACTION@DEVPATH\0KEY=VALUE\0...`) reports a uverbs device going away.
pub(crate) fn is_uverbs_removal(msg: &[u8]) -> bool {
    let mut fields = msg.split(|&b| b == 0);
    let head = fields.next().unwrap_or_default();
    head.starts_with(b"remove@") && fields.any(|f| f == b"SUBSYSTEM=infiniband_verbs")
}

impl Host for Monitor {
    /// Wakes the liveness thread: something is pending, or its descriptors changed.
    fn notify(&self) {
        self.wake.ring();
    }

    /// The descriptors the liveness thread polls for the monitor: its wake-up and the uevent
    /// socket (-1 without one: ignored by poll).
    fn fds(&self) -> [libc::pollfd; 2] {
        [
            libc::pollfd { fd: self.wake.fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.uevents.unwrap_or(-1), events: libc::POLLIN, revents: 0 },
        ]
    }

    /// How long the liveness thread may sleep before the periodic check is due (ms, at least
    /// 1: with the socket a slow check runs too, as a container may get no uevents at all).
    fn timeout_ms(&self) -> i32 {
        self.period.saturating_sub(self.last_check.lock().elapsed()).as_millis().clamp(1, i32::MAX as u128) as i32
    }

    /// After a poll (`fds` as [`Monitor::fds`] gave them, with what the poll found): reads the
    /// wake-up and the kernel's device events, runs a check that is due, and calls the
    /// subscribers of every context found or declared removed.
    fn after_poll(&self, fds: &[libc::pollfd]) {
        let mut check = self.last_check.lock().elapsed() >= self.period;
        // A uverbs device went (watched or not): librdmacm is told too (after-removal hook).
        let mut uverbs_went = false;
        if fds[0].revents != 0 {
            self.wake.drain();
        }
        if let Some(fd) = self.uevents.filter(|_| fds[1].revents != 0) {
            let mut buf = [0u8; 16 << 10];
            loop {
                // SAFETY: a non-blocking socket we own; buf is ours.
                let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n < 0 {
                    // ENOBUFS: events were dropped, one may have been ours.
                    check |= std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOBUFS);
                    break;
                }
                uverbs_went |= is_uverbs_removal(&buf[..n as usize]);
            }
            check |= uverbs_went;
        }
        if check {
            *self.last_check.lock() = std::time::Instant::now();
        }
        let declared: Vec<_> = std::mem::take(&mut *self.pending.lock());
        if declared.is_empty() && !check {
            return;
        }
        // A panicking subscriber (or tracing subscriber) must not end the monitoring.
        let found = if check { guarded(|| self.find_removed()).unwrap_or_default() } else { Vec::new() };
        let removed: Vec<Context> =
            declared.iter().chain(&found).filter_map(Weak::upgrade).map(|inner| Context { inner }).collect();
        self.call(&removed, uverbs_went);
    }

    fn pid(&self) -> u32 {
        self.pid
    }
}

impl Monitor {
    /// The watched contexts whose device is gone, marked removed here (and logged after the
    /// lock).
    fn find_removed(&self) -> Vec<Weak<ContextInner>> {
        let mut watched: Vec<Arc<ContextInner>> = Vec::new();
        {
            let st = self.state.lock();
            for sub in st.subs.values() {
                let Some(inner) = sub.ctx.upgrade() else { continue };
                if !inner.removed.load(Ordering::Acquire) && !watched.iter().any(|g| Arc::ptr_eq(g, &inner)) {
                    watched.push(inner);
                }
            }
        }
        // Checked and dropped outside the lock (the last clone of a context closes it).
        watched
            .into_iter()
            .filter(|inner| inner.node.gone(&Context { inner: inner.clone() }) && mark(inner))
            .map(|inner| Arc::downgrade(&inner))
            .collect()
    }

    /// Calls the subscribers of each removed context (outside the lock: they take their own),
    /// each on its own (a panicking one does not keep the others from running), then the
    /// after-removal hook — also when a device nobody watched went (`uverbs_went`).
    fn call(&self, removed: &[Context], uverbs_went: bool) {
        for ctx in removed {
            let subs: Vec<Callback> = {
                let st = self.state.lock();
                st.subs.values().filter(|s| s.ctx.as_ptr() == Arc::as_ptr(&ctx.inner)).map(|s| s.f.clone()).collect()
            };
            for f in subs {
                guarded(|| f(ctx));
            }
        }
        let hook = AFTER_REMOVAL.load(Ordering::Acquire);
        if !hook.is_null() && (uverbs_went || !removed.is_empty()) {
            // SAFETY: only ever set from a `fn()` (set_after_removal).
            let hook: fn() = unsafe { std::mem::transmute::<*mut (), fn()>(hook) };
            guarded(hook);
        }
    }
}

/// Runs `f`, catching a panic (logged; `None`): the liveness thread must keep running.
fn guarded<T>(f: impl FnOnce() -> T) -> Option<T> {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    if r.is_err() {
        let _ = std::panic::catch_unwind(|| tracing::error!("a device-removal handler panicked; monitoring goes on"));
    }
    r.ok()
}

#[cfg(test)]
mod tests {
    use super::is_uverbs_removal;

    #[test]
    fn only_a_uverbs_removal_counts() {
        let ev = |s: &str| s.replace('|', "\0").into_bytes();
        assert!(is_uverbs_removal(&ev(
            "remove@/devices/virtual/infiniband_verbs/uverbs0|ACTION=remove|SUBSYSTEM=infiniband_verbs|DEVNAME=infiniband/uverbs0"
        )));
        assert!(!is_uverbs_removal(&ev(
            "add@/devices/virtual/infiniband_verbs/uverbs0|ACTION=add|SUBSYSTEM=infiniband_verbs"
        )));
        assert!(!is_uverbs_removal(&ev("remove@/devices/virtual/infiniband_mad/umad0|SUBSYSTEM=infiniband_mad")));
        assert!(!is_uverbs_removal(b""));
    }
}
