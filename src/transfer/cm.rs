//! Connection setup through the RDMA connection manager (librdmacm, via rdma-sys).
//!
//! librdmacm opens device contexts of its own, so a QP in the caller's PD cannot be attached to
//! the `rdma_cm_id`; it stays external: its number travels in `rdma_conn_param.qp_num`, and its
//! RTR/RTS attributes come from `rdma_init_qp_attr`. The application blob rides in the CM
//! private data (at most [`MAX_CM_BLOB`] bytes).

use std::ffi::CStr;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::transfer::{Connection, Options};
use crate::verbs::{Cq, Endpoint, Gid, Pd, Qp};

/// Largest blob a CM connect request carries: the REQ private data of the TCP port space holds
/// 56 bytes, one of which is the blob's length (the CM pads private data with zeros).
pub const MAX_CM_BLOB: usize = 55;
/// Largest blob an accept carries (REP private data: 196 bytes, one for the length).
pub const MAX_CM_ACCEPT_BLOB: usize = 195;

/// `[len][blob]`, as the CM pads private data to a fixed size.
fn frame(blob: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(blob.len() + 1);
    v.push(blob.len() as u8);
    v.extend_from_slice(blob);
    v
}

/// Undoes [`frame`]; a length larger than what arrived is a protocol error.
fn unframe(private: &[u8]) -> Result<Vec<u8>> {
    match private.split_first() {
        None => Ok(Vec::new()),
        Some((&len, rest)) if (len as usize) <= rest.len() => Ok(rest[..len as usize].to_vec()),
        Some((&len, rest)) => {
            Err(Error::Protocol(format!("RDMA CM private data claims {len} bytes, {} arrived", rest.len())))
        }
    }
}

struct Channel(*mut ffi::rdma_event_channel);

impl Channel {
    fn new() -> Result<Channel> {
        // SAFETY: no preconditions.
        let ch = unsafe { ffi::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(Error::verbs("rdma_create_event_channel", 0));
        }
        Ok(Channel(ch))
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: created by rdma_create_event_channel; every id on it is destroyed first.
        unsafe { ffi::rdma_destroy_event_channel(self.0) };
    }
}

struct Id(*mut ffi::rdma_cm_id);

impl Id {
    /// A TCP-port-space id whose events arrive on `channel`.
    fn new(channel: &Channel) -> Result<Id> {
        let mut raw: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: live channel; out-pointer.
        if unsafe { ffi::rdma_create_id(channel.0, &mut raw, std::ptr::null_mut(), ffi::rdma_port_space::RDMA_PS_TCP) }
            != 0
        {
            return Err(Error::verbs("rdma_create_id", 0));
        }
        Ok(Id(raw))
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: a live id whose events have all been acknowledged.
        unsafe {
            ffi::rdma_disconnect(self.0);
            ffi::rdma_destroy_id(self.0);
        }
    }
}

/// The CM objects a connection keeps alive (the id before its channel).
struct CmHold {
    _id: Id,
    _channel: Channel,
}

// SAFETY: only destroyed in Drop; librdmacm objects may be destroyed from any thread.
unsafe impl Send for CmHold {}
// SAFETY: no shared access at all after setup.
unsafe impl Sync for CmHold {}

/// A copied-out CM event (acknowledged already).
struct Event {
    kind: u32,
    status: i32,
    id: *mut ffi::rdma_cm_id,
    private: Vec<u8>,
    qp_num: u32,
}

fn event_name(kind: u32) -> String {
    // SAFETY: rdma_event_str returns a static string for any value.
    let p = unsafe { ffi::rdma_event_str(kind) };
    if p.is_null() {
        return format!("event {kind}");
    }
    // SAFETY: static NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn next_event(ch: &Channel, timeout: Option<Duration>) -> Result<Event> {
    // SAFETY: ch is a live channel; fd is its file descriptor.
    let fd = unsafe { (*ch.0).fd };
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc == 0 {
        return Err(Error::Timeout(timeout.unwrap_or_default(), "an RDMA CM event"));
    }
    if rc < 0 {
        return Err(Error::Io { what: "polling the RDMA CM channel".into(), source: std::io::Error::last_os_error() });
    }
    let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
    // SAFETY: the channel is readable, so this does not block; ev is an out-pointer.
    if unsafe { ffi::rdma_get_cm_event(ch.0, &mut ev) } != 0 {
        return Err(Error::verbs("rdma_get_cm_event", 0));
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
    Ok(out)
}

fn expect_event(ch: &Channel, want: u32, timeout: Option<Duration>) -> Result<Event> {
    let e = next_event(ch, timeout)?;
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

fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
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

fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|source| Error::Io { what: "resolving the RDMA CM address".into(), source })?
        .next()
        .ok_or_else(|| Error::InvalidArgument("the address resolved to nothing".into()))
}

/// The device librdmacm bound `id` to must be the PD's.
fn check_device(id: *mut ffi::rdma_cm_id, pd: &Pd) -> Result<()> {
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

/// Moves our external QP to `state` with the attributes the CM computed for `id`.
fn cm_modify(id: *mut ffi::rdma_cm_id, qp: &Qp, state: ffi::ibv_qp_state::Type) -> Result<()> {
    // SAFETY: ibv_qp_attr is plain old data.
    let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = state;
    let mut mask = 0;
    // SAFETY: a connected/connecting id; out-pointers are valid.
    if unsafe { ffi::rdma_init_qp_attr(id, &mut attr, &mut mask) } != 0 {
        return Err(Error::verbs("rdma_init_qp_attr", 0));
    }
    // SAFETY: our live QP; attr/mask as computed by librdmacm.
    let rc = unsafe { ffi::ibv_modify_qp(qp.as_raw(), &mut attr, mask) };
    if rc != 0 {
        return Err(Error::verbs("ibv_modify_qp", rc));
    }
    Ok(())
}

fn conn_param(qp: &Qp, pd: &Pd, opts: &Options, blob: &[u8]) -> Result<ffi::rdma_conn_param> {
    let dev = pd.context().attributes()?;
    Ok(ffi::rdma_conn_param {
        private_data: blob.as_ptr().cast(),
        private_data_len: blob.len() as u8,
        responder_resources: dev.max_qp_rd_atom.clamp(1, 255) as u8,
        initiator_depth: dev.max_qp_init_rd_atom.clamp(1, 255) as u8,
        flow_control: 1,
        retry_count: opts.retry_count.min(7),
        rnr_retry_count: opts.rnr_retry.min(7),
        srq: 0,
        qp_num: qp.qpn(),
    })
}

fn check_blob(blob: &[u8]) -> Result<()> {
    if blob.len() > MAX_CM_BLOB {
        return Err(Error::InvalidArgument(format!(
            "an RDMA CM blob holds at most {MAX_CM_BLOB} bytes, got {}",
            blob.len()
        )));
    }
    Ok(())
}

/// RDMA CM private data has no room for the shared-secret handshake: refuse rather than
/// connect unauthenticated.
fn check_no_secret(opts: &Options) -> Result<()> {
    if opts.secret.is_some() {
        return Err(Error::InvalidArgument(
            "Options::secret is only supported by the TCP exchange (Listener / Connection::connect), not by RDMA CM"
                .into(),
        ));
    }
    Ok(())
}

fn peer_endpoint(qp: &Qp, qpn: u32) -> Endpoint {
    Endpoint { qpn, psn: 0, gid: Gid::default(), lid: 0, mtu: qp.endpoint().mtu }
}

fn established(
    pd: &Pd,
    opts: &Options,
    prepared: (Qp, Cq, Cq),
    peer_qpn: u32,
    blob: Vec<u8>,
    hold: CmHold,
) -> Result<Connection> {
    let peer = peer_endpoint(&prepared.0, peer_qpn);
    let mut conn = Connection::wrap(pd, opts, prepared, peer, blob)?;
    conn.keep(hold);
    Ok(conn)
}

impl Connection {
    /// Connects through the RDMA connection manager to a [`CmListener`] at `addr` (an IP address
    /// of the peer's RDMA device), in `pd`.
    pub fn connect_cm(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Connection> {
        Connection::connect_cm_with(addr, pd, opts, &[])
    }

    /// As [`Connection::connect_cm`], sending `blob` (≤ [`MAX_CM_BLOB`] bytes) to the peer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `blob` is too long or [`Options::secret`] is set (the shared
    /// secret needs the TCP exchange); [`Error::Verbs`] if an RDMA CM or verbs call fails.
    pub fn connect_cm_with(addr: impl ToSocketAddrs, pd: &Pd, opts: Options, blob: &[u8]) -> Result<Connection> {
        check_blob(blob)?;
        check_no_secret(&opts)?;
        let target = resolve(addr)?;
        let deadline = Instant::now() + opts.connect_timeout;
        let left = || Some(deadline.saturating_duration_since(Instant::now()));
        let channel = Channel::new()?;
        let id = Id::new(&channel)?;
        let mut dst = sockaddr(target);
        let ms = opts.connect_timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: live id; dst is a valid sockaddr.
        if unsafe {
            ffi::rdma_resolve_addr(id.0, std::ptr::null_mut(), (&mut dst as *mut libc::sockaddr_storage).cast(), ms)
        } != 0
        {
            return Err(Error::verbs("rdma_resolve_addr", 0));
        }
        expect_event(&channel, ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, left())?;
        // SAFETY: live, address-resolved id.
        if unsafe { ffi::rdma_resolve_route(id.0, ms) } != 0 {
            return Err(Error::verbs("rdma_resolve_route", 0));
        }
        expect_event(&channel, ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, left())?;
        check_device(id.0, pd)?;
        let prepared = Connection::prepare(pd, &opts)?;
        let framed = frame(blob);
        let mut param = conn_param(&prepared.0, pd, &opts, &framed)?;
        // SAFETY: live, route-resolved id; param (and the blob it points at) outlive the call.
        if unsafe { ffi::rdma_connect(id.0, &mut param) } != 0 {
            return Err(Error::verbs("rdma_connect", 0));
        }
        let resp = expect_event(&channel, ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE, left())?;
        cm_modify(id.0, &prepared.0, ffi::ibv_qp_state::IBV_QPS_RTR)?;
        cm_modify(id.0, &prepared.0, ffi::ibv_qp_state::IBV_QPS_RTS)?;
        // SAFETY: live id that received its connect response.
        if unsafe { ffi::rdma_establish(id.0) } != 0 {
            return Err(Error::verbs("rdma_establish", 0));
        }
        let peer_blob = unframe(&resp.private)?;
        established(pd, &opts, prepared, resp.qp_num, peer_blob, CmHold { _id: id, _channel: channel })
    }
}

/// Accepts RDMA CM connections on an address of a local RDMA device.
pub struct CmListener {
    // Kept for its Drop (the listening id); events arrive on `channel`.
    _id: Id,
    channel: Channel,
    pd: Pd,
    opts: Options,
}

// SAFETY: the listener's id and channel move with it; accept takes &mut self, so one thread at a
// time reads its event channel.
unsafe impl Send for CmListener {}

impl CmListener {
    /// Listens on `addr` (an IP address of a local RDMA device, and a port).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if [`Options::secret`] is set (the shared secret needs the TCP
    /// exchange); [`Error::Verbs`] if binding or listening fails.
    pub fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<CmListener> {
        check_no_secret(&opts)?;
        let at = resolve(addr)?;
        let channel = Channel::new()?;
        let id = Id::new(&channel)?;
        let mut sa = sockaddr(at);
        // SAFETY: live id; valid sockaddr.
        if unsafe { ffi::rdma_bind_addr(id.0, (&mut sa as *mut libc::sockaddr_storage).cast()) } != 0 {
            return Err(Error::verbs("rdma_bind_addr", 0));
        }
        // SAFETY: bound id.
        if unsafe { ffi::rdma_listen(id.0, 16) } != 0 {
            return Err(Error::verbs("rdma_listen", 0));
        }
        Ok(CmListener { _id: id, channel, pd: pd.clone(), opts })
    }

    /// Accepts the next connection.
    pub fn accept(&mut self) -> Result<Connection> {
        self.accept_with(&[])
    }

    /// Accepts the next connection, answering with `blob` (≤ [`MAX_CM_ACCEPT_BLOB`] bytes).
    pub fn accept_with(&mut self, blob: &[u8]) -> Result<Connection> {
        if blob.len() > MAX_CM_ACCEPT_BLOB {
            return Err(Error::InvalidArgument(format!(
                "an RDMA CM accept blob holds at most {MAX_CM_ACCEPT_BLOB} bytes, got {}",
                blob.len()
            )));
        }
        let req = expect_event(&self.channel, ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST, None)?;
        let child = Id(req.id);
        let peer_blob = unframe(&req.private)?;
        check_device(child.0, &self.pd)?;
        let prepared = Connection::prepare(&self.pd, &self.opts)?;
        cm_modify(child.0, &prepared.0, ffi::ibv_qp_state::IBV_QPS_RTR)?;
        cm_modify(child.0, &prepared.0, ffi::ibv_qp_state::IBV_QPS_RTS)?;
        let framed = frame(blob);
        let mut param = conn_param(&prepared.0, &self.pd, &self.opts, &framed)?;
        // SAFETY: the child id of a connect request; param outlives the call.
        if unsafe { ffi::rdma_accept(child.0, &mut param) } != 0 {
            return Err(Error::verbs("rdma_accept", 0));
        }
        let est = expect_event(
            &self.channel,
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            Some(self.opts.connect_timeout),
        )?;
        if est.id != child.0 {
            return Err(Error::Protocol("RDMA CM: ESTABLISHED for another connection".into()));
        }
        // Give the connection its own channel, so the listener can go first.
        let own = Channel::new()?;
        // SAFETY: live child id and channel.
        if unsafe { ffi::rdma_migrate_id(child.0, own.0) } != 0 {
            return Err(Error::verbs("rdma_migrate_id", 0));
        }
        established(&self.pd, &self.opts, prepared, req.qp_num, peer_blob, CmHold { _id: child, _channel: own })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_framing() {
        let mut padded = frame(b"remote");
        padded.resize(56, 0);
        assert_eq!(unframe(&padded).unwrap(), b"remote");
        assert_eq!(unframe(&[]).unwrap(), b"");
        assert!(matches!(unframe(&[200, 1, 2]), Err(Error::Protocol(_))));
        assert!(check_blob(&[0; MAX_CM_BLOB]).is_ok());
        assert!(check_blob(&[0; MAX_CM_BLOB + 1]).is_err());
        assert!(check_no_secret(&Options::default()).is_ok());
        let secret = Some(crate::transfer::Secret::new("k").unwrap());
        assert!(matches!(check_no_secret(&Options { secret, ..Options::default() }), Err(Error::InvalidArgument(_))));
    }
}
