//! The connection watcher: finds dead connections without waiting for an operation to time out.
//! It runs on the process's one liveness thread ([`crate::verbs::liveness`]), with the device
//! monitor.
//!
//! An idle connection is not a dead one: a receive may wait for hours. What tells them apart is
//! watched here, for every connection at once, with one `poll(2)`:
//! - the TCP stream a connection was set up over (kept open for this): the peer's kernel closes
//!   it when the peer drops its connection or its process exits, even on `SIGKILL`;
//! - the RDMA CM event channel of a CM connection (`DISCONNECTED`, `DEVICE_REMOVAL`);
//! - the asynchronous events of each device in use (`ibv_get_async_event`: port down, QP or CQ
//!   in error, device fatal);
//! - for connections with keepalive, their probes (see the `keepalive` module): the poll's
//!   timeout is the next probe's schedule.
//!
//! Each finding fails the connection it concerns with [`Error::Disconnected`]: the failure is
//! recorded first, then the QP is moved to the error state, so every waiter gets its request's
//! flush and the reason — a receive waiting without a deadline included.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rdma_sys as ffi;

#[cfg(doc)]
use crate::error::Error;
use crate::error::{Disconnect, Result};
use crate::fork::ForkLock;
use crate::os::Bell;
use crate::transfer::liveness::link::Link;
pub(crate) use crate::transfer::liveness::source::Source;
use crate::verbs::liveness;
use crate::verbs::removal::{self, Subscription};
use crate::verbs::Context;

/// Keeps a connection watched; dropping it stops the watching (before the connection destroys
/// what the registration names).
pub(crate) struct Registration {
    watcher: &'static Watcher,
    token: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // In a fork()ed child the parent's watcher has no thread, and its lock may have been
        // held at the fork: leave it alone.
        if self.watcher.pid == std::process::id() {
            self.watcher.remove(self.token);
        }
    }
}

/// Starts watching `links` (a connection and its control channel): the device events of
/// `ctx`, and `source` if there is one.
///
/// # Errors
/// [`Error::Io`] if the liveness thread (see [`crate::verbs::liveness`]) or a wake-up
/// descriptor cannot be created.
pub(crate) fn watch(ctx: &Context, links: Vec<Arc<Link>>, source: Option<Source>) -> Result<Registration> {
    let w = watcher()?;
    let token = {
        let mut st = w.state.lock();
        st.next += 1;
        let token = st.next;
        let key = ctx.as_raw() as usize;
        let dev = match st.devices.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(Device::new(ctx, token, w)?),
        };
        dev.refs += 1;
        st.entries.insert(token, Entry { links, source, device: key });
        token
    };
    w.notify();
    Ok(Registration { watcher: w, token })
}

struct Entry {
    links: Vec<Arc<Link>>,
    /// `None` once it reported the peer gone (a closed socket stays readable).
    source: Option<Source>,
    device: usize,
}

struct Device {
    /// Kept open while a connection on it is watched.
    ctx: Context,
    fd: RawFd,
    refs: usize,
    /// Tells this device from an earlier one at the same address (a stale poll result).
    id: u64,
    /// Fails the device's connections when it is found removed.
    _removal: Subscription,
}

impl Device {
    fn new(ctx: &Context, id: u64, w: &'static Watcher) -> Result<Device> {
        let key = ctx.as_raw() as usize;
        let removal = removal::subscribe(ctx, Arc::new(move |_: &Context| w.device_removed(key, id)))?;
        // SAFETY: a live context.
        let fd = unsafe { (*ctx.as_raw()).async_fd };
        // Non-blocking, so that a read finding nothing (another reader took the event) returns.
        // SAFETY: fcntl on a descriptor the context owns.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            tracing::warn!(
                device = ctx.name(),
                "could not make the async event descriptor non-blocking; not watching it"
            );
        }
        Ok(Device { ctx: ctx.clone(), fd: if ok { fd } else { -1 }, refs: 0, id, _removal: removal })
    }
}

#[derive(Default)]
struct State {
    next: u64,
    entries: HashMap<u64, Entry>,
    devices: HashMap<usize, Device>,
}

/// Which connections a device event concerns.
enum Target {
    Qp(usize),
    Cq(usize),
    Port(u8),
    All,
}

impl State {
    /// Reads every queued async event of a device and fails the connections they concern.
    /// `hangup`: poll reported an error or hang-up on its descriptor.
    fn device_events(&mut self, key: usize, id: u64, hangup: bool) {
        let Some(dev) = self.devices.get_mut(&key).filter(|d| d.id == id) else { return };
        loop {
            let mut ev = std::mem::MaybeUninit::<ffi::ibv_async_event>::zeroed();
            // SAFETY: a live context with a non-blocking descriptor; ev is an out-parameter.
            if unsafe { ffi::ibv_get_async_event(dev.ctx.as_raw(), ev.as_mut_ptr()) } != 0 {
                let e = std::io::Error::last_os_error();
                if hangup || e.raw_os_error() != Some(libc::EAGAIN) {
                    // A removed device's descriptor would report the same forever.
                    tracing::warn!(
                        device = dev.ctx.name(),
                        "reading async events failed ({e}); no longer watching them"
                    );
                    dev.fd = -1;
                }
                return;
            }
            // SAFETY: filled in by the call. The type is read as a number: a value this binding
            // does not know must not become an enum.
            let (kind, elem) = unsafe {
                let p = ev.as_ptr();
                (
                    std::ptr::addr_of!((*p).event_type).cast::<u32>().read(),
                    std::ptr::addr_of!((*p).element).cast::<u64>().read(),
                )
            };
            // SAFETY: acknowledged once, at once (a QP or CQ being destroyed waits for it).
            unsafe { ffi::ibv_ack_async_event(ev.as_mut_ptr()) };
            let qp_event = |event| Some((Disconnect::QpError { event }, Target::Qp(elem as usize)));
            let verdict = match kind {
                0 => Some((Disconnect::QpError { event: "IBV_EVENT_CQ_ERR" }, Target::Cq(elem as usize))),
                1 => qp_event("IBV_EVENT_QP_FATAL"),
                2 => qp_event("IBV_EVENT_QP_REQ_ERR"),
                3 => qp_event("IBV_EVENT_QP_ACCESS_ERR"),
                7 => qp_event("IBV_EVENT_PATH_MIG_ERR"),
                8 => {
                    // Also what a provider that can cut processes off reports on removal.
                    removal::declare(&dev.ctx);
                    Some((Disconnect::DeviceFatal, Target::All))
                }
                10 => {
                    // The union's port_num is the low 32 bits.
                    let port = elem as u32 as u8;
                    Some((Disconnect::PortDown { port }, Target::Port(port)))
                }
                _ => None,
            };
            tracing::debug!(target: "mralloc::transfer", device = dev.ctx.name(), kind, "async event");
            let Some((why, target)) = verdict else { continue };
            for link in self.entries.values().filter(|e| e.device == key).flat_map(|e| &e.links) {
                let hit = match target {
                    Target::Qp(qp) => link.has_qp(qp),
                    Target::Cq(cq) => link.has_cq(cq),
                    Target::Port(p) => link.on_port(p),
                    Target::All => true,
                };
                if hit {
                    link.fail(why);
                }
            }
        }
    }

    fn source_event(&mut self, token: u64) {
        let Some(e) = self.entries.get_mut(&token) else { return };
        let Some((mut why, keep)) = e.source.as_ref().map(Source::check) else { return };
        if !keep {
            e.source = None;
        }
        // Removing a device disconnects its CM connections too, and the `DISCONNECTED` may be
        // read before the id's `DEVICE_REMOVAL`: the removal is the reason if the device is gone.
        if why == Some(Disconnect::CmDisconnected)
            && self.devices.get(&e.device).is_some_and(|dev| removal::removed_now(&dev.ctx))
        {
            why = Some(Disconnect::DeviceRemoved);
        }
        if why == Some(Disconnect::DeviceRemoved) {
            if let Some(dev) = self.devices.get(&e.device) {
                removal::declare(&dev.ctx);
            }
        }
        for link in why.iter().flat_map(|&why| e.links.iter().map(move |l| (l, why))) {
            link.0.fail(link.1);
        }
    }
}

struct Watcher {
    state: Mutex<State>,
    /// Rung when the set of descriptors changes.
    wake: Bell,
    /// The process that made it (a fork()ed child makes its own).
    pid: u32,
    /// The liveness thread's current round: what each descriptor it polls for the watcher
    /// belongs to, and the connections with keepalive. Only that thread takes it.
    round: Mutex<Round>,
}

#[derive(Default)]
struct Round {
    keys: Vec<Key>,
    probing: Vec<Arc<Link>>,
}

/// Serialises starting a watcher.
pub(crate) static START: ForkLock<()> = ForkLock::new(());

/// The latest watcher started (in this process, or in the parent of a fork()ed child).
static WATCHER: AtomicPtr<Watcher> = AtomicPtr::new(std::ptr::null_mut());

/// This process's watcher, if one was started here.
fn current() -> Option<&'static Watcher> {
    // SAFETY: a non-null pointer came from Box::leak and is never freed.
    let w = unsafe { WATCHER.load(Ordering::Acquire).as_ref() }?;
    (w.pid == std::process::id()).then_some(w)
}

fn watcher() -> Result<&'static Watcher> {
    if let Some(w) = current() {
        return Ok(w);
    }
    // Serialises starting one (a fork()ed child finds it unlocked, see `crate::fork`).
    let _g = START.lock();
    if let Some(w) = current() {
        return Ok(w);
    }
    // Run by the process's one liveness thread, which the device monitor starts (first: a
    // failure here leaks nothing).
    removal::monitor()?;
    let wake = Bell::new("the connection watcher's eventfd")?;
    let w: &'static Watcher = Box::leak(Box::new(Watcher {
        state: Mutex::new(State::default()),
        wake,
        pid: std::process::id(),
        round: Mutex::new(Round::default()),
    }));
    liveness::serve(w);
    WATCHER.store(std::ptr::from_ref(w).cast_mut(), Ordering::Release);
    Ok(w)
}

/// What a polled descriptor belongs to.
#[derive(Clone, Copy)]
enum Key {
    Wake,
    Device(usize, u64),
    Entry(u64),
}

impl Watcher {
    fn notify(&self) {
        self.wake.ring();
    }

    /// The device (if still the one registered under `key`) was removed: fails every connection
    /// on it.
    fn device_removed(&self, key: usize, id: u64) {
        let st = self.state.lock();
        if st.devices.get(&key).is_none_or(|d| d.id != id) {
            return;
        }
        for link in st.entries.values().filter(|e| e.device == key).flat_map(|e| &e.links) {
            link.fail(Disconnect::DeviceRemoved);
        }
    }

    fn remove(&self, token: u64) {
        let (entry, gone) = {
            let mut st = self.state.lock();
            let Some(e) = st.entries.remove(&token) else { return };
            let dev = st.devices.get_mut(&e.device).expect("a watched connection's device is registered");
            dev.refs -= 1;
            let gone = (dev.refs == 0).then(|| st.devices.remove(&e.device));
            (e, gone)
        };
        self.notify();
        // Outside the lock: the entry's links may be the last holders of a connection's
        // completion state (its CQs are destroyed with it), and closing a device (the last
        // reference) is a verbs call too.
        drop(entry);
        drop(gone);
    }
}

impl liveness::Watch for Watcher {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn add_fds(&self, fds: &mut Vec<libc::pollfd>) {
        let mut round = self.round.lock();
        let Round { keys, probing } = &mut *round;
        keys.clear();
        probing.clear();
        let mut add = |fd: RawFd, key: Key| {
            if fd >= 0 {
                fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                keys.push(key);
            }
        };
        add(self.wake.fd(), Key::Wake);
        let st = self.state.lock();
        for (&k, d) in &st.devices {
            add(d.fd, Key::Device(k, d.id));
        }
        for (&t, e) in &st.entries {
            if let Some(s) = &e.source {
                add(s.fd(), Key::Entry(t));
            }
            probing.extend(e.links.iter().filter(|l| l.probes()).cloned());
        }
    }

    fn has_due(&self) -> bool {
        !self.round.lock().probing.is_empty()
    }

    fn due(&self) -> i32 {
        // Outside the state lock (a probe's reap takes a connection's locks).
        let probing = std::mem::take(&mut self.round.lock().probing);
        let timeout = keepalive_ticks(&probing);
        self.round.lock().probing = probing;
        timeout
    }

    fn handle(&self, fds: &[libc::pollfd]) -> bool {
        let round = self.round.lock();
        let mut st = self.state.lock();
        // A panic here (a tracing subscriber's) must not end the watching for good.
        let handled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(&mut st, &self.wake, fds, &round.keys)));
        if let Err(payload) = handled {
            std::mem::forget(payload);
            let _ = std::panic::catch_unwind(|| {
                tracing::error!("the connection watcher panicked handling an event; it goes on");
            });
        }
        fds.iter().zip(&round.keys).any(|(p, k)| matches!(k, Key::Wake) && p.revents != 0)
    }
}

/// Runs the keepalive schedules of `links`; returns the poll timeout (ms, -1: none) until the
/// next is due.
fn keepalive_ticks(links: &[Arc<Link>]) -> i32 {
    // Each link at its own time: one that took a while must not date the next one's probe.
    let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        links.iter().filter_map(|l| l.keepalive(Instant::now())).min()
    }))
    .unwrap_or_else(|payload| {
        std::mem::forget(payload);
        let _ = std::panic::catch_unwind(|| {
            tracing::error!("the connection watcher panicked running keepalive probes; it goes on");
        });
        Some(Instant::now() + std::time::Duration::from_millis(100))
    });
    match next {
        // Rounded up: waking a millisecond early would only look again.
        Some(t) => t.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
        None => -1,
    }
}

/// Handles what one poll found.
fn handle(st: &mut State, wake: &Bell, fds: &[libc::pollfd], keys: &[Key]) {
    for (pfd, &key) in fds.iter().zip(keys) {
        if pfd.revents == 0 {
            continue;
        }
        match key {
            Key::Wake => wake.drain(),
            Key::Device(k, id) => {
                st.device_events(k, id, pfd.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0)
            }
            Key::Entry(t) => st.source_event(t),
        }
    }
}
