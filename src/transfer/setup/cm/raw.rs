//! librdmacm's objects as owned values: event channels, ids, copied-out events, and the
//! attributes the CM computes for our own (external) queue pairs.

use std::ffi::CStr;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::RawFd;
use std::time::Duration;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::transfer::Options;
use crate::verbs::{Endpoint, Pd, Qp};

pub(crate) struct Channel(pub(crate) *mut ffi::rdma_event_channel);

impl Channel {
    pub(crate) fn new() -> Result<Channel> {
        // RDMA CM is in use: librdmacm must hear about removed devices (see
        // `forget_removed_devices`).
        crate::verbs::removal::set_after_removal(forget_removed_devices);
        // SAFETY: no preconditions.
        let ch = unsafe { ffi::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(Error::verbs("rdma_create_event_channel", 0));
        }
        Ok(Channel(ch))
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: a live channel.
        unsafe { (*self.0).fd }
    }

    /// Makes reading an event with nothing queued fail with `EAGAIN` instead of blocking.
    pub(crate) fn set_nonblocking(&self) -> Result<()> {
        let fd = self.fd();
        // SAFETY: fcntl on the channel's own descriptor.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(Error::Io {
                what: "making the RDMA CM event channel non-blocking".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: created by rdma_create_event_channel; every id on it is destroyed first.
        unsafe { ffi::rdma_destroy_event_channel(self.0) };
    }
}

/// A CM id, and the fork generation it was made in (a fork()ed child must not destroy it: the
/// kernel object is shared with the parent).
pub(crate) struct Id(pub(crate) *mut ffi::rdma_cm_id, pub(crate) Born);

impl Id {
    /// A TCP-port-space id whose events arrive on `channel`.
    pub(crate) fn new(channel: &Channel) -> Result<Id> {
        let mut raw: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: live channel; out-pointer.
        if unsafe { ffi::rdma_create_id(channel.0, &mut raw, std::ptr::null_mut(), ffi::rdma_port_space::RDMA_PS_TCP) }
            != 0
        {
            return Err(Error::verbs("rdma_create_id", 0));
        }
        Ok(Id(raw, Born::now()))
    }

    /// Moves the id's events (queued and future) to `channel`.
    pub(crate) fn migrate(&self, channel: &Channel) -> Result<()> {
        // SAFETY: live id and channel; every event of the id we read was acknowledged.
        if unsafe { ffi::rdma_migrate_id(self.0, channel.0) } != 0 {
            return Err(Error::verbs("rdma_migrate_id", 0));
        }
        Ok(())
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        if !self.1.here() {
            return; // the parent's (a fork()ed child's copy)
        }
        // The id may be the last one on a removed device: then librdmacm is told after
        // destroying it (checked before: `verbs` goes with the id).
        let removal = crate::verbs::removal::removals() > 0
            // SAFETY: a live id; `verbs` is NULL or librdmacm's live context of its device.
            && unsafe { crate::verbs::removal::raw_context_gone((*self.0).verbs) };
        // SAFETY: a live id whose events have all been acknowledged.
        unsafe {
            ffi::rdma_disconnect(self.0);
            ffi::rdma_destroy_id(self.0);
        }
        if removal {
            forget_removed_devices();
        }
    }
}

/// Has librdmacm compare its device list with the system's. librdmacm opens a verbs context
/// of its own for each device a CM id uses and closes it only when it finds the device gone
/// from the list while no id uses it, or when the last id of a device it found gone is
/// destroyed: without this, its context would hold a removed device (whose removal waits for
/// every context to close, see `crate::verbs::removal`) until the process exits.
///
/// librdmacm opens every device present while it does this (as any `rdma_get_devices` caller
/// has it do), and gives up when no device is left: the last device's removal then waits for
/// the process to exit (rxe, siw; a device whose driver can cut processes off, such as mlx5,
/// is removed regardless).
pub(crate) fn forget_removed_devices() {
    // SAFETY: librdmacm's own list, handed straight back (NULL: nothing to free).
    unsafe {
        let list = ffi::rdma_get_devices(std::ptr::null_mut());
        if !list.is_null() {
            ffi::rdma_free_devices(list);
        }
    }
}

/// The CM objects a connection keeps alive, kept for their Drop (the id before its channel).
pub(crate) struct CmHold {
    pub(crate) id: Id,
    pub(crate) _channel: Channel,
}

// SAFETY: only destroyed in Drop; librdmacm objects may be destroyed from any thread.
unsafe impl Send for CmHold {}
// SAFETY: no shared access at all after setup.
unsafe impl Sync for CmHold {}

/// A copied-out CM event (acknowledged already).
pub(crate) struct Event {
    pub(crate) kind: u32,
    pub(crate) status: i32,
    pub(crate) id: *mut ffi::rdma_cm_id,
    pub(crate) private: Vec<u8>,
    pub(crate) qp_num: u32,
}

pub(crate) fn event_name(kind: u32) -> String {
    // SAFETY: rdma_event_str returns a static string for any value.
    let p = unsafe { ffi::rdma_event_str(kind) };
    if p.is_null() {
        return format!("event {kind}");
    }
    // SAFETY: static NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Takes the next event: `None` if none is queued and the channel is non-blocking (on a
/// blocking channel this waits for one).
pub(crate) fn try_event(ch: &Channel) -> Result<Option<Event>> {
    let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
    // SAFETY: a live channel; ev is an out-pointer.
    if unsafe { ffi::rdma_get_cm_event(ch.0, &mut ev) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            return Ok(None);
        }
        return Err(Error::Io { what: "reading an RDMA CM event (rdma_get_cm_event)".into(), source: e });
    }
    // SAFETY: ev is a valid event until acknowledged; the conn params are valid for connection
    // events (and zero/NULL otherwise).
    let out = unsafe {
        let e = &*ev;
        let conn = e.param.conn;
        let private = if conn.private_data.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(conn.private_data.cast::<u8>(), conn.private_data_len as usize).to_vec()
        };
        Event { kind: e.event, status: e.status, id: e.id, private, qp_num: conn.qp_num }
    };
    // SAFETY: acknowledging the event we got (the ids it names stay valid).
    unsafe { ffi::rdma_ack_cm_event(ev) };
    Ok(Some(out))
}

/// The kind of the next event on a non-blocking channel (acknowledged at once): `None` if none
/// is queued. For a connection's own channel after setup, where only the kind matters.
///
/// # Safety
/// `ch` is a live event channel.
pub(crate) unsafe fn raw_event(ch: *mut ffi::rdma_event_channel) -> Result<Option<u32>> {
    let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
    // SAFETY: the caller's live channel; ev is an out-pointer.
    if unsafe { ffi::rdma_get_cm_event(ch, &mut ev) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            return Ok(None);
        }
        return Err(Error::Io { what: "reading an RDMA CM event (rdma_get_cm_event)".into(), source: e });
    }
    // SAFETY: a valid event until acknowledged, which happens right after.
    let kind = unsafe { (*ev).event };
    // SAFETY: acknowledging the event we got.
    unsafe { ffi::rdma_ack_cm_event(ev) };
    Ok(Some(kind))
}

/// Waits (at most `timeout`, `None`: forever) for the next event. Interrupted waits resume
/// with the time left.
pub(crate) fn next_event(ch: &Channel, timeout: Option<Duration>) -> Result<Event> {
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let ms = deadline.map_or(-1, |d| {
            let left = d.saturating_duration_since(std::time::Instant::now());
            // Round up: a wait of 0 ms that has not reached the deadline would spin.
            left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
        });
        let mut pfd = libc::pollfd { fd: ch.fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc == 0 {
            return Err(Error::Timeout(timeout.unwrap_or_default(), "an RDMA CM event"));
        }
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Io { what: "polling the RDMA CM channel".into(), source: e });
        }
        // Readable: an event is queued unless another reader of a non-blocking channel took it
        // first (then wait again).
        if let Some(e) = try_event(ch)? {
            return Ok(e);
        }
    }
}

/// Checks that `e` is a `want` event.
pub(crate) fn expect_kind(e: Event, want: u32) -> Result<Event> {
    if e.kind != want {
        return Err(Error::Protocol(format!(
            "RDMA CM: expected {}, got {} (status {})",
            event_name(want),
            event_name(e.kind),
            e.status
        )));
    }
    Ok(e)
}

pub(crate) fn expect_event(ch: &Channel, want: u32, timeout: Option<Duration>) -> Result<Event> {
    expect_kind(next_event(ch, timeout)?, want)
}

pub(crate) fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    ss
}

/// The address a CM id's peer has (`rdma_get_peer_addr`), if it is an IP one.
///
/// # Safety
/// `id` is a live CM id.
pub(crate) unsafe fn peer_addr_of(id: *mut ffi::rdma_cm_id) -> Option<SocketAddr> {
    if id.is_null() {
        return None;
    }
    // SAFETY: the caller's live id; the address is a field of its route, valid while it lives.
    let sa: *const libc::sockaddr = std::ptr::from_ref(unsafe { ffi::rdma_get_peer_addr(&*id) }).cast();
    // SAFETY: a sockaddr of its family's size, as the id's route holds it.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let sin = sa.cast::<libc::sockaddr_in>().read_unaligned();
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                let sin6 = sa.cast::<libc::sockaddr_in6>().read_unaligned();
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                    ip,
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

pub(crate) fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|source| Error::Io { what: "resolving the RDMA CM address".into(), source })?
        .next()
        .ok_or_else(|| Error::InvalidArgument("the address resolved to nothing".into()))
}

/// The device librdmacm bound `id` to must be the PD's.
pub(crate) fn check_device(id: *mut ffi::rdma_cm_id, pd: &Pd) -> Result<()> {
    // SAFETY: a resolved id has a verbs context whose device name is a static C string.
    let name = unsafe {
        let verbs = (*id).verbs;
        if verbs.is_null() {
            return Err(Error::Protocol("RDMA CM resolved no device for this address".into()));
        }
        CStr::from_ptr(ffi::ibv_get_device_name((*verbs).device)).to_string_lossy().into_owned()
    };
    if name != pd.context().name() {
        return Err(Error::InvalidArgument(format!(
            "RDMA CM routes this address through {name}, but the PD is on {}",
            pd.context().name()
        )));
    }
    Ok(())
}

/// Moves our external QP to `state` with the attributes the CM computed for `id`, as `adjust`
/// changes them.
pub(crate) fn cm_modify_with(
    id: *mut ffi::rdma_cm_id,
    qp: &Qp,
    state: ffi::ibv_qp_state::Type,
    adjust: impl FnOnce(&mut ffi::ibv_qp_attr),
) -> Result<()> {
    // SAFETY: ibv_qp_attr is plain old data.
    let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = state;
    let mut mask = 0;
    // SAFETY: a connected/connecting id; out-pointers are valid.
    if unsafe { ffi::rdma_init_qp_attr(id, &mut attr, &mut mask) } != 0 {
        return Err(Error::verbs("rdma_init_qp_attr", 0));
    }
    adjust(&mut attr);
    // SAFETY: our live QP; attr/mask as computed by librdmacm (fields changed by `adjust` are
    // among those the mask names for this transition).
    let rc = unsafe { ffi::ibv_modify_qp(qp.as_raw(), &mut attr, mask) };
    if rc != 0 {
        return Err(Error::verbs("ibv_modify_qp", rc));
    }
    Ok(())
}

/// Connects our external data QP: RTR, then RTS, with the CM's attributes.
pub(crate) fn cm_connect(id: *mut ffi::rdma_cm_id, qp: &Qp) -> Result<()> {
    cm_modify_with(id, qp, ffi::ibv_qp_state::IBV_QPS_RTR, |_| {})?;
    cm_modify_with(id, qp, ffi::ibv_qp_state::IBV_QPS_RTS, |_| {})
}

/// Connects a control channel's QP to the peer's control QP `peer_qpn` with the attributes the
/// CM computed for the data QPs (same path, same starting PSNs on both sides), retrying
/// receiver-not-ready forever as the control channel needs.
pub(crate) fn cm_connect_control(id: *mut ffi::rdma_cm_id, qp: &Qp, peer_qpn: u32) -> Result<()> {
    cm_modify_with(id, qp, ffi::ibv_qp_state::IBV_QPS_RTR, |a| a.dest_qp_num = peer_qpn)?;
    cm_modify_with(id, qp, ffi::ibv_qp_state::IBV_QPS_RTS, |a| a.rnr_retry = 7)
}

pub(crate) fn conn_param(qp: &Qp, pd: &Pd, opts: &Options, private: &[u8]) -> Result<ffi::rdma_conn_param> {
    let dev = pd.context().attributes()?;
    Ok(ffi::rdma_conn_param {
        private_data: private.as_ptr().cast(),
        private_data_len: private.len() as u8,
        responder_resources: dev.max_qp_rd_atom.clamp(1, 255) as u8,
        initiator_depth: dev.max_qp_init_rd_atom.clamp(1, 255) as u8,
        flow_control: 1,
        retry_count: opts.qp.retry_count.min(7),
        rnr_retry_count: opts.qp.rnr_retry.min(7),
        // The CM tells the peer whether this side takes receives from a shared queue.
        srq: u8::from(qp.srq().is_some()),
        qp_num: qp.qpn(),
    })
}

/// The peer's endpoint as the connected `qp` addresses it: the CM tells its QP number, and the
/// QP's address vector (set by the CM from the route) its GID — what a `RemoteDesc` names the
/// peer's device by (zero where the QP has no global route, or cannot be queried).
pub(crate) fn peer_endpoint(qp: &Qp, qpn: u32) -> Endpoint {
    let gid = qp.remote_gid().ok().flatten().unwrap_or_default();
    Endpoint { qpn, psn: 0, gid, lid: 0, mtu: qp.endpoint().mtu }
}
