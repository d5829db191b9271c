//! Connection setup through the RDMA connection manager (librdmacm, via rdma-sys).
//!
//! librdmacm opens device contexts of its own, so a QP in the caller's PD cannot be attached to
//! the `rdma_cm_id`; it stays external: its number travels in `rdma_conn_param.qp_num`, and its
//! RTR/RTS attributes come from `rdma_init_qp_attr`. The application blob rides in the CM
//! private data (at most [`MAX_CM_BLOB`] bytes), after the rights this side's QP grants the
//! peer, and so does the control channel's QP number when both sides are async (see
//! `private`): the control QP is connected with the data QP's attributes and the peer's control
//! QP number. A connect that finds nothing listening at the peer is tried again until
//! [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout) (the peer may be starting).

mod private;
mod raw;

use std::ffi::CStr;
use std::net::ToSocketAddrs;
#[cfg(feature = "tokio")]
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::transfer::liveness::watch::Source;
use crate::transfer::setup::backoff::Backoff;
use crate::transfer::setup::control::{Established, Prepared};
use crate::transfer::setup::wire::Deadline;
use crate::transfer::{Connection, Options};
use crate::verbs::{Access, Pd};

pub use private::{MAX_ASYNC_CM_ACCEPT_BLOB, MAX_ASYNC_CM_BLOB, MAX_CM_ACCEPT_BLOB, MAX_CM_BLOB};

pub(crate) use private::check_accept_blob;
use private::{check_blob, frame, unframe, Unframed};
pub(crate) use raw::raw_event;
#[cfg(feature = "tokio")]
use raw::try_event;
use raw::{
    check_device, cm_connect, cm_connect_control, conn_param, expect_event, expect_kind, next_event, peer_addr_of,
    peer_endpoint, resolve, sockaddr, Channel, CmHold, Id,
};

/// RDMA CM private data has no room for the shared-secret handshake: refuse rather than
/// connect unauthenticated.
fn check_no_secret(opts: &Options) -> Result<()> {
    if opts.setup.secret.is_some() {
        return Err(Error::InvalidArgument(
            "SetupOptions::secret is only supported by the TCP exchange (Listener / Connection::connect), not by RDMA CM"
                .into(),
        ));
    }
    Ok(())
}

/// Wraps the connected data QP (and the prepared control QP, connected to `peer_control`, if
/// both sides offered one) into a connection that keeps the CM objects.
fn established(
    pd: &Pd,
    opts: &Options,
    prepared: Prepared,
    peer_qpn: u32,
    (blob, peer_control, peer_grants): Unframed,
    hold: CmHold,
) -> Result<Established> {
    let peer = peer_endpoint(&prepared.data.0, peer_qpn);
    let control = prepared.control.as_ref().zip(peer_control).map(|(mine, qpn)| peer_endpoint(&mine.0, qpn));
    let mut conn = prepared.wrap(pd, opts, peer, control, blob, peer_grants)?;
    // SAFETY: the connection's live id.
    conn.set_peer_addr(unsafe { peer_addr_of(hold.id.0) });
    // The channel now only brings DISCONNECTED / DEVICE_REMOVAL: the watcher reads it.
    hold._channel.set_nonblocking()?;
    let channel = hold._channel.0;
    conn.keep(hold);
    conn.start_watch(Some(Source::Cm(channel)))?;
    Ok(conn)
}

impl Connection {
    /// Connects through the RDMA connection manager to a [`CmListener`] at `addr` (an IP address
    /// of the peer's RDMA device), in `pd`.
    ///
    /// # Errors
    /// As [`Connection::connect_cm_with`].
    pub fn connect_cm(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<Connection> {
        Connection::connect_cm_with(addr, pd, opts, &[])
    }

    /// As [`Connection::connect_cm`], sending `blob` (≤ [`MAX_CM_BLOB`] bytes) to the peer.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `blob` is too long,
    ///   [`SetupOptions::secret`](crate::transfer::SetupOptions::secret) is set (the shared secret
    ///   needs the TCP exchange), `addr` resolves to nothing, or the address routes through another
    ///   device than `pd`'s.
    /// - [`Error::Io`] if `addr` cannot be resolved or the CM's event channel cannot be read.
    /// - [`Error::Timeout`] if resolving the address and route and the peer's answer take longer
    ///   than [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout) (the error names the time that was left), or nothing
    ///   listens at `addr` until then: a connect the peer's CM rejects for want of a listener
    ///   (the peer is starting) is tried again, after a pause growing to half a second, until
    ///   the deadline.
    /// - [`Error::Protocol`] if the CM reports another event than expected (address or route
    ///   resolution failed, the peer rejected the connection otherwise or is unreachable),
    ///   resolves no device, or the peer's reply is malformed (or comes from an older mralloc,
    ///   whose private data carries no rights).
    /// - [`Error::Verbs`] if an RDMA CM or verbs call fails; as [`Connection::pair`] for
    ///   creating the queue pair.
    pub fn connect_cm_with(addr: impl ToSocketAddrs, pd: &Pd, opts: Options, blob: &[u8]) -> Result<Connection> {
        Connection::connect_cm_offering(addr, pd, opts, blob, false).map(Established::into_blocking)
    }

    /// As [`Connection::connect_cm_with`]; with `control`, offers a control channel (set up if
    /// the listener offers one too), which leaves [`MAX_ASYNC_CM_BLOB`] bytes for `blob`.
    pub(crate) fn connect_cm_offering(
        addr: impl ToSocketAddrs,
        pd: &Pd,
        opts: Options,
        blob: &[u8],
        control: bool,
    ) -> Result<Established> {
        let max = if control { MAX_ASYNC_CM_BLOB } else { MAX_CM_BLOB };
        check_blob(blob, max, "an RDMA CM connect blob")?;
        Connection::connect_cm_framed(addr, pd, opts, control, |rights, offer| frame(rights, blob, offer))
    }

    /// The connect, tried again while nothing listens at `addr`: `private` makes the REQ's
    /// private data from the rights this side's QP grants and the control QP's number (if
    /// `control`).
    fn connect_cm_framed(
        addr: impl ToSocketAddrs,
        pd: &Pd,
        opts: Options,
        control: bool,
        private: impl Fn(Access, Option<u32>) -> Vec<u8>,
    ) -> Result<Established> {
        check_no_secret(&opts)?;
        let target = resolve(addr)?;
        // Overflow-safe, as the TCP setup's (`Duration::MAX` means no limit).
        let deadline = Deadline::after(opts.setup.connect_timeout).at();
        let not_listening = || {
            Error::Timeout(
                opts.setup.connect_timeout,
                "an RDMA CM listener at the peer (every connect was rejected: nothing listens there)",
            )
        };
        let mut backoff = Backoff::new();
        let mut rejected = false;
        loop {
            match connect_cm_once(target, pd, &opts, control, deadline, &private) {
                Ok(Attempt::Connected(est)) => return Ok(*est),
                Ok(Attempt::NotListening) => rejected = true,
                // The deadline passed during a try after nothing listened: that is the reason.
                Err(Error::Timeout(..)) if rejected => return Err(not_listening()),
                Err(e) => return Err(e),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(not_listening());
            }
            std::thread::sleep(backoff.pause(left));
            if Instant::now() >= deadline {
                return Err(not_listening());
            }
        }
    }
}

/// How one RDMA CM connect attempt ended, if not with an error.
enum Attempt {
    Connected(Box<Established>),
    /// The peer's CM rejected the request because nothing listens at the address (yet).
    NotListening,
}

/// One connect attempt, within `deadline`: resolve, prepare the QPs, connect.
fn connect_cm_once(
    target: std::net::SocketAddr,
    pd: &Pd,
    opts: &Options,
    control: bool,
    deadline: Instant,
    private: &impl Fn(Access, Option<u32>) -> Vec<u8>,
) -> Result<Attempt> {
    let left = || Some(deadline.saturating_duration_since(Instant::now()));
    let channel = Channel::new()?;
    let id = Id::new(&channel)?;
    let mut dst = sockaddr(target);
    let ms = opts.setup.connect_timeout.as_millis().min(i32::MAX as u128) as i32;
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
    let prepared = Prepared::new(pd, opts, control)?;
    let framed = private(prepared.grants(), prepared.control.as_ref().map(|c| c.0.qpn()));
    let mut param = conn_param(&prepared.data.0, pd, opts, &framed)?;
    // SAFETY: live, route-resolved id; param (and the data it points at) outlive the call.
    if unsafe { ffi::rdma_connect(id.0, &mut param) } != 0 {
        return Err(Error::verbs("rdma_connect", 0));
    }
    let resp = next_event(&channel, left())?;
    if resp.kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED && no_listener(resp.status) {
        tracing::debug!(target: "mralloc::transfer", %target, status = resp.status, "RDMA CM connect rejected: nothing listens yet");
        return Ok(Attempt::NotListening);
    }
    let resp = expect_kind(resp, ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE)?;
    let unframed = unframe(&resp.private)?;
    let peer_control = unframed.1;
    cm_connect(id.0, &prepared.data.0)?;
    // The control QP is ready before the listener learns the connection is established.
    if let (Some(mine), Some(qpn)) = (&prepared.control, peer_control) {
        cm_connect_control(id.0, &mine.0, qpn)?;
    }
    // SAFETY: live id that received its connect response.
    if unsafe { ffi::rdma_establish(id.0) } != 0 {
        return Err(Error::verbs("rdma_establish", 0));
    }
    let hold = CmHold { id, _channel: channel };
    established(pd, opts, prepared, resp.qp_num, unframed, hold).map(|e| Attempt::Connected(Box::new(e)))
}

/// Whether a REJECTED event's status says nothing listens at the address: the reason
/// `IB_CM_REJ_INVALID_SERVICE_ID` (InfiniBand and RoCE CMs, rxe's included) or `-ECONNREFUSED`
/// (iWARP). A listener's own rejection (`IB_CM_REJ_CONSUMER_DEFINED`) is not retried.
fn no_listener(status: i32) -> bool {
    const IB_CM_REJ_INVALID_SERVICE_ID: i32 = 8;
    status == IB_CM_REJ_INVALID_SERVICE_ID || status == -libc::ECONNREFUSED
}

/// A connect request taken from a listener, its id already moved to an event channel of its
/// own (so requests and the events of connections being accepted never mix).
pub(crate) struct CmRequest {
    child: Id,
    own: Channel,
    private: Vec<u8>,
    qp_num: u32,
}

// SAFETY: the request owns its id and channel outright (nothing else refers to them); librdmacm
// objects may be used from any thread.
unsafe impl Send for CmRequest {}

/// Accepts RDMA CM connections on an address of a local RDMA device.
pub struct CmListener {
    /// The listening id; its events (and those of requests not taken yet) arrive on `channel`.
    id: Id,
    channel: Channel,
    pd: Pd,
    opts: Options,
    /// The listening id's device was removed (it got `DEVICE_REMOVAL`): every accept fails.
    removed: std::sync::atomic::AtomicBool,
}

// SAFETY: the listener's id and channel move with it; reading its channel is safe from any
// thread (each read takes one whole event).
unsafe impl Send for CmListener {}
// SAFETY: shared use only reads events from the channel (see above) or its descriptor.
unsafe impl Sync for CmListener {}

impl CmListener {
    /// Listens on `addr` (an IP address of a local RDMA device, and a port).
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if
    ///   [`SetupOptions::secret`](crate::transfer::SetupOptions::secret) is set (the shared secret
    ///   needs the TCP exchange) or `addr` resolves to nothing.
    /// - [`Error::Io`] if `addr` cannot be resolved.
    /// - [`Error::Verbs`] if creating the CM event channel or id, binding (e.g. the address is in
    ///   use) or listening fails.
    /// - [`Error::DeviceRemoved`] if `pd`'s device was removed.
    pub fn bind(addr: impl ToSocketAddrs, pd: &Pd, opts: Options) -> Result<CmListener> {
        check_no_secret(&opts)?;
        pd.context().usable_for_new()?;
        let at = resolve(addr)?;
        let channel = Channel::new()?;
        // Several threads may wait in accept: each polls, then reads without blocking (a
        // blocking read by a thread that lost the race would wait for the next event, which
        // a removed device never sends).
        channel.set_nonblocking()?;
        let id = Id::new(&channel)?;
        let mut sa = sockaddr(at);
        // SAFETY: live id; valid sockaddr.
        if unsafe { ffi::rdma_bind_addr(id.0, (&mut sa as *mut libc::sockaddr_storage).cast()) } != 0 {
            return Err(Error::verbs("rdma_bind_addr", 0));
        }
        // Connect requests no accept call has taken yet queue up to `setup.max_handshakes`; the
        // kernel rejects those beyond.
        let backlog = opts.setup.max_handshakes.clamp(1, i32::MAX as usize) as i32;
        // SAFETY: bound id.
        if unsafe { ffi::rdma_listen(id.0, backlog) } != 0 {
            return Err(Error::verbs("rdma_listen", 0));
        }
        Ok(CmListener { id, channel, pd: pd.clone(), opts, removed: std::sync::atomic::AtomicBool::new(false) })
    }

    /// Accepts the next connection.
    ///
    /// # Errors
    /// As [`CmListener::accept_with`].
    pub fn accept(&self) -> Result<Connection> {
        self.accept_with(&[])
    }

    /// Accepts the next connection, answering with `blob` (≤ [`MAX_CM_ACCEPT_BLOB`] bytes).
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `blob` is too long (checked before a request is taken)
    ///   or the request came through another device than the PD's.
    /// - [`Error::Timeout`] if the peer does not confirm the connection within
    ///   [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout).
    /// - [`Error::Protocol`] for a malformed request, a peer that rejected or dropped the
    ///   connection meanwhile.
    /// - [`Error::DeviceRemoved`] once the listener's device was removed: the listener is done
    ///   (drop it, so that the kernel can finish the removal; bind a new one on another or the
    ///   recreated device).
    /// - [`Error::Verbs`] if an RDMA CM or verbs call fails (as [`Connection::pair`] for
    ///   creating the queue pair); [`Error::Io`] if the CM's event channel cannot be read.
    ///
    /// Only a removed device ends the listener: after any other error, accept the next
    /// connection. A rejected or failed request is rejected toward its client (its CM id is
    /// destroyed, which answers it with a REJ), so nothing of it is left.
    ///
    /// Several threads may accept at once: a client that never confirms its connection (it sent a
    /// request, got the answer and went silent) holds one accept call for
    /// [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout), not the
    /// others. Requests no accept call has taken yet queue up to
    /// [`SetupOptions::max_handshakes`](crate::transfer::SetupOptions::max_handshakes); the kernel
    /// rejects those beyond.
    pub fn accept_with(&self, blob: &[u8]) -> Result<Connection> {
        self.id.1.check("this RDMA CM listener")?;
        check_accept_blob(blob, false)?;
        let req = self.next_request()?;
        accept_request(req, &self.pd, &self.opts, blob, false).map(Established::into_blocking)
    }

    /// Waits for the next connect request. Only one waiting call gets the listening id's
    /// `DEVICE_REMOVAL`: the others look at the device once a second.
    fn next_request(&self) -> Result<CmRequest> {
        loop {
            self.check_device()?;
            let e = match raw::next_event(&self.channel, Some(Duration::from_secs(1))) {
                Err(Error::Timeout(..)) => continue,
                e => e?,
            };
            if let Some(req) = self.take_request(e)? {
                return Ok(req);
            }
        }
    }

    /// [`Error::DeviceRemoved`] once the PD's device was found removed, or the listening
    /// id's device (a wildcard listener may listen through another one).
    fn check_device(&self) -> Result<()> {
        let ctx = self.pd.context();
        if ctx.is_removed() || self.removed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::DeviceRemoved { device: self.device_name() });
        }
        Ok(())
    }

    /// The listening id's device (librdmacm's context of it), else the PD's.
    fn device_name(&self) -> String {
        // SAFETY: a live id; `verbs` (librdmacm's context of the bound device) and its device
        // stay valid while the id lives.
        unsafe {
            let v = (*self.id.0).verbs;
            if v.is_null() {
                return self.pd.context().name().to_string();
            }
            CStr::from_ptr((*(*v).device).name.as_ptr()).to_string_lossy().into_owned()
        }
    }

    /// The next connect request, if one is queued (the channel must be non-blocking).
    #[cfg(feature = "tokio")]
    pub(crate) fn try_request(&self) -> Result<Option<CmRequest>> {
        self.id.1.check("this RDMA CM listener")?;
        self.check_device()?;
        while let Some(e) = try_event(&self.channel)? {
            if let Some(req) = self.take_request(e)? {
                return Ok(Some(req));
            }
        }
        Ok(None)
    }

    /// A connect request becomes a [`CmRequest`] (its id moved to a channel of its own). Other
    /// events are passed over (`None`): an address change, or an event of a request another
    /// accept took but has not moved yet (that accept then times out). The listening id's
    /// device going away ends the listener.
    fn take_request(&self, e: raw::Event) -> Result<Option<CmRequest>> {
        use ffi::rdma_cm_event_type as T;
        match e.kind {
            T::RDMA_CM_EVENT_CONNECT_REQUEST => {
                let child = Id(e.id, crate::fork::Born::now());
                let own = Channel::new()?;
                child.migrate(&own)?;
                Ok(Some(CmRequest { child, own, private: e.private, qp_num: e.qp_num }))
            }
            T::RDMA_CM_EVENT_DEVICE_REMOVAL if e.id == self.id.0 => {
                self.removed.store(true, std::sync::atomic::Ordering::Release);
                let device = self.device_name();
                let ctx = self.pd.context();
                if device == ctx.name() {
                    crate::verbs::removal::declare(ctx);
                }
                Err(Error::DeviceRemoved { device })
            }
            kind => {
                tracing::debug!("RDMA CM listener: passing over {} (status {})", raw::event_name(kind), e.status);
                Ok(None)
            }
        }
    }

    /// Makes the listener's event channel non-blocking, for a reactor to watch [`Self::fd`].
    #[cfg(feature = "tokio")]
    pub(crate) fn set_nonblocking(&self) -> Result<()> {
        self.channel.set_nonblocking()
    }

    /// The event channel's descriptor (readable when a request is queued).
    #[cfg(feature = "tokio")]
    pub(crate) fn fd(&self) -> RawFd {
        self.channel.fd()
    }
}

/// Accepts `req`, answering with `blob`, and waits (at most
/// [`SetupOptions::connect_timeout`](crate::transfer::SetupOptions::connect_timeout)) until the
/// connection is established; with `control`, offers a control channel (set up if the peer offered
/// one too). `blob` passed [`check_accept_blob`] before the request was taken (a caller's mistake
/// must not cost a peer its connection). Blocks.
pub(crate) fn accept_request(
    req: CmRequest,
    pd: &Pd,
    opts: &Options,
    blob: &[u8],
    control: bool,
) -> Result<Established> {
    let CmRequest { child, own, private, qp_num } = req;
    // From here on the id and its channel drop together, the id first (on every error path).
    let hold = CmHold { id: child, _channel: own };
    let child = hold.id.0;
    let unframed = unframe(&private)?;
    let peer_control = unframed.1;
    check_device(child, pd)?;
    // A control QP only if the peer offered one: nothing is created that cannot be connected.
    let prepared = Prepared::new(pd, opts, control && peer_control.is_some())?;
    cm_connect(child, &prepared.data.0)?;
    if let (Some(mine), Some(qpn)) = (&prepared.control, peer_control) {
        cm_connect_control(child, &mine.0, qpn)?;
    }
    let framed = frame(prepared.grants(), blob, prepared.control.as_ref().map(|c| c.0.qpn()));
    let mut param = conn_param(&prepared.data.0, pd, opts, &framed)?;
    // SAFETY: the child id of a connect request; param (and the data it points at) outlive the
    // call.
    if unsafe { ffi::rdma_accept(child, &mut param) } != 0 {
        return Err(Error::verbs("rdma_accept", 0));
    }
    let est = expect_event(
        &hold._channel,
        ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
        Some(opts.setup.connect_timeout),
    )?;
    if est.id != child {
        return Err(Error::Protocol("RDMA CM: ESTABLISHED for another connection".into()));
    }
    established(pd, opts, prepared, qp_num, unframed, hold)
}

#[cfg(test)]
mod tests;
