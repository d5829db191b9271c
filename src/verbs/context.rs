//! An opened RDMA device: ports, MTU, GID table.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::verbs::confine::Confinement;
use crate::verbs::device::{numa_node_of, DeviceList};
use crate::verbs::{Gid, Mtu};

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID (GRH optional).
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID, GRH required.
    Ethernet,
    /// The driver did not say.
    Unspecified,
}

/// Logical state of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Link down.
    Down,
    /// Link up, not yet configured by the subnet manager.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready to carry traffic.
    Active,
    /// Any other value the driver reported.
    Other(u32),
}

/// What one port of a device reports (`ibv_query_port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub port: u8,
    /// Logical state.
    pub state: PortState,
    /// MTU currently in use on the link.
    pub active_mtu: Mtu,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Number of entries in the GID table.
    pub gid_table_len: u32,
    /// `active_width` as `ibv_query_port` reports it (a code: 1 = 1x, 2 = 4x, ...).
    pub active_width: u8,
    /// `active_speed` as `ibv_query_port` reports it (a code: 1 = SDR, ..., 32 = EDR, ...).
    pub active_speed: u8,
}

impl PortInfo {
    /// The link's rate in Gb/s, lanes times per-lane rate (the table is in
    /// `src/verbs/speed.rs`: e.g. 4x EDR, what a 100 GbE RoCE port reports, is 100); `None`
    /// for codes outside it.
    pub fn gbps(&self) -> Option<f64> {
        crate::verbs::speed::gbps(self.active_width, self.active_speed)
    }
}

/// One populated entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Index to pass as a GID index.
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// `"RoCE v2"`, `"IB/RoCE v1"` or `None` where sysfs does not say.
    pub kind: Option<String>,
}

pub(crate) struct ContextInner {
    pub(crate) ctx: *mut ffi::ibv_context,
    pub(crate) name: String,
    /// A fork()ed child neither uses nor destroys its parent's verbs objects (see `crate::fork`).
    pub(crate) born: Born,
    /// The device was found removed (see `crate::verbs::removal`).
    pub(crate) removed: AtomicBool,
    /// How to tell later that the device went, taken when it was opened.
    pub(crate) node: crate::verbs::removal::Node,
    /// Whether the device confines memory windows to their range (probed on first use).
    pub(crate) confinement: Confinement,
    /// Where [`Context::default_gid`] last found the default GID: port, index, GID.
    default_gid: std::sync::Mutex<Option<(u8, u32, Gid)>>,
}

// SAFETY: an ibv_context is safe to use from any thread (libibverbs locks internally); the
// pointer is only freed in Drop, when no other reference exists.
unsafe impl Send for ContextInner {}
// SAFETY: see Send; all verbs that take a context are thread-safe.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if !self.born.here() {
            return; // the parent's (a fork()ed child's copy)
        }
        // SAFETY: ctx came from ibv_open_device; every PD/CQ holds an Arc to this inner value,
        // so none is alive any more.
        let rc = unsafe { ffi::ibv_close_device(self.ctx) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

/// An opened RDMA device (`ibv_context`). Cheap to clone; closed when the last clone, PD, CQ and
/// QP made from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("name", &self.inner.name).finish()
    }
}

/// The same opened device (not: the same device name).
impl PartialEq for Context {
    fn eq(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
impl Eq for Context {}

impl Context {
    pub(crate) fn from_raw(ctx: *mut ffi::ibv_context, name: String) -> Context {
        // SAFETY: a context ibv_open_device just returned.
        let node = unsafe { crate::verbs::removal::Node::of_raw(ctx) };
        Context {
            inner: Arc::new(ContextInner {
                ctx,
                name,
                born: Born::now(),
                removed: AtomicBool::new(false),
                node,
                confinement: Confinement::default(),
                default_gid: std::sync::Mutex::new(None),
            }),
        }
    }

    /// Whether the device was found removed (`rdma link delete`, a driver unbound, a NIC
    /// unplugged). mralloc notices at once on the kernel's device event (at the latest within
    /// 5 s) for devices it has
    /// connections or bound heaps on: their connections fail with
    /// [`crate::Disconnect::DeviceRemoved`], heaps drop their registrations with it, and new
    /// objects on it fail with [`Error::DeviceRemoved`]. The kernel finishes removing a device
    /// such as rxe only once every object made on it (connections, listeners, PDs, contexts) is
    /// dropped.
    pub fn is_removed(&self) -> bool {
        self.inner.removed.load(Ordering::Acquire)
    }

    /// As [`Context::usable`], and [`Error::DeviceRemoved`] once the device was found removed:
    /// for making new objects.
    pub(crate) fn usable_for_new(&self) -> Result<()> {
        self.usable()?;
        if self.is_removed() {
            return Err(Error::DeviceRemoved { device: self.inner.name.clone() });
        }
        Ok(())
    }

    /// `Ok` unless this is a fork()ed child of the process that opened the device:
    /// [`Error::Forked`] then (verbs objects of the parent are not the child's to use).
    #[inline(always)]
    pub(crate) fn usable(&self) -> Result<()> {
        self.inner.born.check("this RDMA device context (and what was made from it)")
    }

    /// Whether this process opened the device (not a fork()ed child of it): its objects are
    /// destroyed only then.
    pub(crate) fn owned_here(&self) -> bool {
        self.inner.born.here()
    }

    /// Opens the device called `name`.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if `ibv_get_device_list`, or `ibv_open_device` on the device, fails.
    /// - [`Error::NoSuchDevice`] (listing the devices that exist) if no device is called `name`.
    pub fn open(name: &str) -> Result<Context> {
        let list = DeviceList::get()?;
        let found = list.iter().find(|d| d.name() == name).map(|d| d.open());
        found.unwrap_or_else(|| Err(Error::NoSuchDevice { name: name.to_string(), available: list.names() }))
    }

    /// Opens the first device that has an `ACTIVE` port.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if `ibv_get_device_list` fails.
    /// - [`Error::NoActiveDevice`] if no device has an `ACTIVE` port. Devices that fail to open or
    ///   to be queried are skipped, so their errors (e.g. `EACCES`) also end up as this variant.
    pub fn open_first_active() -> Result<Context> {
        let list = DeviceList::get()?;
        for d in list.iter() {
            let Ok(ctx) = d.open() else { continue };
            if ctx.first_active_port().is_some() {
                return Ok(ctx);
            }
        }
        Err(Error::NoActiveDevice { available: list.names() })
    }

    /// Opens the device named by the `MRALLOC_DEVICE` environment variable, or the first active
    /// one when it is unset. This is what tests, examples and connection helpers use.
    ///
    /// # Errors
    /// As [`Context::open`] when `MRALLOC_DEVICE` is set (and not empty), else as
    /// [`Context::open_first_active`].
    pub fn open_default() -> Result<Context> {
        match std::env::var("MRALLOC_DEVICE") {
            Ok(name) if !name.is_empty() => Context::open(&name),
            _ => Context::open_first_active(),
        }
    }

    /// The device's kernel name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's NUMA node, if it has one (see [`crate::verbs::numa_node_of`]).
    ///
    /// # Errors
    /// As [`crate::verbs::numa_node_of`]: also `None`, with no error, when sysfs cannot be read.
    pub fn numa_node(&self) -> Option<u32> {
        numa_node_of(&self.inner.name)
    }

    /// The raw `ibv_context` pointer, for calls mralloc does not wrap. It stays valid while
    /// this `Context` (or anything made from it) lives. Once a connection is made on it,
    /// mralloc's liveness thread reads the context's asynchronous events (its `async_fd` is
    /// made non-blocking): do not call `ibv_get_async_event` on it yourself.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.inner.ctx
    }

    /// Device attributes (`ibv_query_device`).
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_query_device` fails.
    pub fn attributes(&self) -> Result<ffi::ibv_device_attr> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is a live context; attr is a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_device(self.inner.ctx, &mut attr) };
        if rc != 0 {
            return Err(Error::verbs("ibv_query_device", rc));
        }
        Ok(attr)
    }

    /// Number of physical ports.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_query_device` fails.
    pub fn port_count(&self) -> Result<u8> {
        Ok(self.attributes()?.phys_port_cnt)
    }

    /// Queries port `port` (1-based).
    ///
    /// # Errors
    /// - [`Error::NoSuchIndex`] if `port` is 0 or above the device's port count.
    /// - [`Error::Verbs`] if `ibv_query_device` or `ibv_query_port` fails.
    pub fn port(&self, port: u8) -> Result<PortInfo> {
        let count = self.port_count()?;
        if port == 0 || port > count {
            return Err(Error::NoSuchIndex {
                what: "port",
                index: port.into(),
                device: self.inner.name.clone(),
                valid: format!("1..={count}"),
            });
        }
        // SAFETY: ibv_port_attr is plain old data; all-zero is a valid value.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is live, port is in range, attr is a valid out-pointer of the full size.
        let rc = unsafe { ffi::___ibv_query_port(self.inner.ctx, port, &mut attr) };
        if rc != 0 {
            return Err(Error::verbs("ibv_query_port", rc));
        }
        Ok(PortInfo {
            port,
            state: match attr.state {
                ffi::ibv_port_state::IBV_PORT_DOWN => PortState::Down,
                ffi::ibv_port_state::IBV_PORT_INIT => PortState::Init,
                ffi::ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
                ffi::ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
                other => PortState::Other(other),
            },
            active_mtu: Mtu::from_raw(attr.active_mtu).unwrap_or(Mtu::Mtu256),
            max_mtu: Mtu::from_raw(attr.max_mtu).unwrap_or(Mtu::Mtu256),
            lid: attr.lid,
            link_layer: match attr.link_layer {
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
            gid_table_len: attr.gid_tbl_len.max(0) as u32,
            active_width: attr.active_width,
            active_speed: attr.active_speed,
        })
    }

    /// The first port in the `ACTIVE` state.
    ///
    /// # Errors
    /// Returns `None` if no port is `ACTIVE`, and also (without an error) when querying the device
    /// or a port fails.
    pub fn first_active_port(&self) -> Option<u8> {
        let count = self.port_count().ok()?;
        (1..=count).find(|&p| matches!(self.port(p), Ok(PortInfo { state: PortState::Active, .. })))
    }

    /// GID `index` of `port`.
    ///
    /// # Errors
    /// - [`Error::NoSuchIndex`] if `port` does not exist, or `index` is not below the port's GID
    ///   table length.
    /// - [`Error::Verbs`] if `ibv_query_device`, `ibv_query_port` or `ibv_query_gid` fails.
    pub fn gid(&self, port: u8, index: u32) -> Result<Gid> {
        let info = self.port(port)?;
        if index >= info.gid_table_len {
            return Err(Error::NoSuchIndex {
                what: "GID index",
                index,
                device: self.inner.name.clone(),
                valid: format!("0..{}", info.gid_table_len),
            });
        }
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: ctx is live, port and index are in range, gid is a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.inner.ctx, port, index as i32, &mut gid) };
        if rc != 0 {
            return Err(Error::verbs("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok(Gid::from_bytes(unsafe { gid.raw }))
    }

    /// The populated (non-zero) entries of `port`'s GID table.
    ///
    /// # Errors
    /// As [`Context::port`]. Entries that cannot be queried are left out, not reported.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let info = self.port(port)?;
        let mut out = Vec::new();
        for index in 0..info.gid_table_len {
            let Ok(gid) = self.gid(port, index) else { continue };
            if gid.is_zero() {
                continue;
            }
            let path = format!("/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}", self.inner.name);
            let kind = std::fs::read_to_string(path).ok().map(|s| s.trim().to_string());
            out.push(GidEntry { index, gid, kind });
        }
        Ok(out)
    }

    /// The GID a queue pair on this device presents when neither port nor GID index is given
    /// (the first active port, [`Context::default_gid_index`]): what a peer connected with
    /// default options sees as this side's GID, and so the device identity a
    /// [`crate::RemoteDesc`] keys its rkeys by.
    ///
    /// # Errors
    /// [`Error::NoActiveDevice`] if no port is `ACTIVE`; as [`Context::default_gid_index`] and
    /// [`Context::gid`].
    ///
    /// Finding the default index scans the GID table (~13 ms per device in the TCG VM); the
    /// place it was found is remembered, and a later call only checks that the port is still
    /// the first active one and the entry there still holds the same GID (else it scans again).
    pub fn default_gid(&self) -> Result<Gid> {
        let port = self
            .first_active_port()
            .ok_or_else(|| Error::NoActiveDevice { available: vec![self.name().to_string()] })?;
        let remembered = *self.inner.default_gid.lock().unwrap_or_else(|p| p.into_inner());
        let overridden = std::env::var_os("MRALLOC_GID_INDEX").is_some();
        if let Some((p, index, gid)) = remembered.filter(|_| !overridden) {
            if p == port && self.gid(port, index).is_ok_and(|now| now == gid) {
                return Ok(gid);
            }
        }
        // (A preferred entry that appears only later, e.g. an IPv4 address added after a scan
        // that chose another, is not noticed here: a peer then gets NoKeyForDevice, never a
        // wrong key.)
        let index = self.default_gid_index(port)?;
        let gid = self.gid(port, index)?;
        if !overridden {
            *self.inner.default_gid.lock().unwrap_or_else(|p| p.into_inner()) = Some((port, index, gid));
        }
        Ok(gid)
    }

    /// The GID index to use on `port` when none is given: `MRALLOC_GID_INDEX` if set; on RoCE,
    /// the first RoCE v2 entry holding an IPv4-mapped address (what perftest and rping use),
    /// then the first RoCE v2 entry; on InfiniBand, 0.
    ///
    /// # Errors
    /// - As [`Context::port`] (a set `MRALLOC_GID_INDEX` is returned as is, unchecked and
    ///   without querying anything; an unparsable one is ignored).
    /// - [`Error::NoSuchIndex`] if the port is RoCE and its GID table has no populated entry.
    pub fn default_gid_index(&self, port: u8) -> Result<u32> {
        if let Some(i) = std::env::var("MRALLOC_GID_INDEX").ok().and_then(|s| s.trim().parse().ok()) {
            return Ok(i);
        }
        let info = self.port(port)?;
        if info.link_layer != LinkLayer::Ethernet {
            return Ok(0);
        }
        let table = self.gid_table(port)?;
        let v2 = |e: &&GidEntry| e.kind.as_deref().is_some_and(|k| k.contains("v2"));
        table
            .iter()
            .filter(v2)
            .find(|e| e.gid.is_ipv4_mapped())
            .or_else(|| table.iter().find(v2))
            .or_else(|| table.first())
            .map(|e| e.index)
            .ok_or_else(|| Error::NoSuchIndex {
                what: "GID index",
                index: 0,
                device: self.inner.name.clone(),
                valid: "none populated".into(),
            })
    }
}
