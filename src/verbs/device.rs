//! Finding RDMA devices: the device list, names, GUIDs, NUMA nodes and ports.

use std::ffi::CStr;
use std::path::PathBuf;

use rdma_sys as ffi;

use crate::error::{Error, Result};
use crate::verbs::{Context, PortInfo};

/// What the system knows about one RDMA device, without opening it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Node GUID (host byte order).
    pub guid: u64,
    /// NUMA node of the device's PCI function; `None` when it has none (virtual devices such as
    /// rxe) or the kernel reports `-1`.
    pub numa_node: Option<u32>,
}

impl DeviceInfo {
    /// What a rail group chooses by, per port: state, link layer and rate
    /// ([`PortInfo::gbps`]); with [`DeviceInfo::numa_node`], where the device sits. Opens the
    /// device to query its ports.
    ///
    /// ```no_run
    /// for dev in mralloc::verbs::devices()? {
    ///     for p in dev.ports()? {
    ///         println!("{} port {}: {:?} {:?} {:?} Gb/s, numa {:?}", dev.name, p.port, p.state, p.link_layer, p.gbps(), dev.numa_node);
    ///     }
    /// }
    /// # Ok::<(), mralloc::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Context::open`] (e.g. [`Error::NoSuchDevice`] if the device went away since it was
    /// listed, [`Error::Verbs`] if `ibv_open_device` fails), and [`Error::Verbs`] if
    /// `ibv_query_device` or `ibv_query_port` fails.
    pub fn ports(&self) -> Result<Vec<PortInfo>> {
        let ctx = Context::open(&self.name)?;
        (1..=ctx.port_count()?).map(|p| ctx.port(p)).collect()
    }
}

/// The devices present on this machine, in the order libibverbs lists them.
///
/// ```no_run
/// for dev in mralloc::verbs::devices()? {
///     println!("{} guid {:016x} numa {:?}", dev.name, dev.guid, dev.numa_node);
/// }
/// # Ok::<(), mralloc::Error>(())
/// ```
///
/// # Errors
/// [`Error::Verbs`] if `ibv_get_device_list` fails — except with `ENOSYS` (no kernel RDMA
/// support), which gives an empty list.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    Ok(list.iter().map(|d| d.info()).collect())
}

/// The NUMA node of a device, read from `/sys/class/infiniband/<name>/device/numa_node` — unless
/// the environment variable [`NUMA_OVERRIDE`] (`MRALLOC_NUMA_NODE=<device>:<node>,...`) names
/// the device: then that node, for machines whose sysfs does not tell (virtual devices,
/// containers that hide sysfs, a VM whose virtual NIC sits on a known node).
///
/// Returns `None` when the device has none: the file is missing (virtual devices) or holds `-1`.
///
/// # Errors
/// Also `None` (no error is reported) when the file cannot be read or does not hold a number.
pub fn numa_node_of(name: &str) -> Option<u32> {
    if let Some(node) = std::env::var(NUMA_OVERRIDE).ok().and_then(|v| parse_numa_override(&v, name)) {
        return Some(node);
    }
    let path: PathBuf = ["/sys/class/infiniband", name, "device", "numa_node"].iter().collect();
    parse_numa_node(&std::fs::read_to_string(path).ok()?)
}

/// The environment variable that names devices' NUMA nodes where sysfs cannot:
/// `MRALLOC_NUMA_NODE=<device>:<node>[,<device>:<node>...]` (e.g. `mlx5_0:1,rxe0:0`).
pub const NUMA_OVERRIDE: &str = "MRALLOC_NUMA_NODE";

/// The node [`NUMA_OVERRIDE`]'s value `value` gives device `name`, if it names it (entries
/// that do not parse are skipped).
fn parse_numa_override(value: &str, name: &str) -> Option<u32> {
    value
        .split(',')
        .filter_map(|entry| entry.split_once(':'))
        .find(|(device, _)| device.trim() == name)
        .and_then(|(_, node)| node.trim().parse().ok())
}

pub(crate) fn parse_numa_node(text: &str) -> Option<u32> {
    let n: i64 = text.trim().parse().ok()?;
    u32::try_from(n).ok()
}

/// An owned `ibv_get_device_list` result; freed on drop.
pub(crate) struct DeviceList {
    ptr: *mut *mut ffi::ibv_device,
    len: usize,
}

/// One entry of a [`DeviceList`], valid while the list lives.
pub(crate) struct DeviceRef<'a> {
    dev: *mut ffi::ibv_device,
    _list: &'a DeviceList,
}

impl DeviceList {
    pub(crate) fn get() -> Result<DeviceList> {
        let mut n: libc::c_int = 0;
        // SAFETY: ibv_get_device_list writes the count into `n` and returns a NULL-terminated
        // array we own until ibv_free_device_list.
        let ptr = unsafe { ffi::ibv_get_device_list(&mut n) };
        if ptr.is_null() {
            let err = Error::verbs("ibv_get_device_list", 0);
            // ENOSYS means no kernel support at all: that is "no devices", not a failure.
            if err.errno() == Some(libc::ENOSYS) {
                return Ok(DeviceList { ptr, len: 0 });
            }
            return Err(err);
        }
        Ok(DeviceList { ptr, len: n.max(0) as usize })
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = DeviceRef<'_>> {
        (0..self.len).map(move |i| DeviceRef {
            // SAFETY: i < len, and the array holds `len` valid device pointers.
            dev: unsafe { *self.ptr.add(i) },
            _list: self,
        })
    }

    pub(crate) fn names(&self) -> Vec<String> {
        self.iter().map(|d| d.name()).collect()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: ptr came from ibv_get_device_list and is freed exactly once.
            unsafe { ffi::ibv_free_device_list(self.ptr) };
        }
    }
}

impl DeviceRef<'_> {
    pub(crate) fn name(&self) -> String {
        // SAFETY: dev is a valid device while the list lives; the name is a NUL-terminated
        // string owned by libibverbs.
        let p = unsafe { ffi::ibv_get_device_name(self.dev) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: p is non-null and NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    pub(crate) fn guid(&self) -> u64 {
        // SAFETY: dev is valid while the list lives.
        u64::from_be(unsafe { ffi::ibv_get_device_guid(self.dev) })
    }

    pub(crate) fn info(&self) -> DeviceInfo {
        let name = self.name();
        DeviceInfo { numa_node: numa_node_of(&name), guid: self.guid(), name }
    }

    pub(crate) fn open(&self) -> Result<Context> {
        // SAFETY: dev is valid while the list lives; the returned context does not depend on
        // the list staying alive (libibverbs keeps its own reference to the device).
        let ctx = unsafe { ffi::ibv_open_device(self.dev) };
        if ctx.is_null() {
            return Err(Error::verbs("ibv_open_device", 0));
        }
        Ok(Context::from_raw(ctx, self.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_node_parsing() {
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node("0"), Some(0));
        assert_eq!(parse_numa_node("-1\n"), None);
        assert_eq!(parse_numa_node("garbage"), None);
    }

    #[test]
    fn the_override_names_devices_nodes() {
        assert_eq!(parse_numa_override("mlx5_0:1,rxe0:0", "rxe0"), Some(0));
        assert_eq!(parse_numa_override(" mlx5_0 : 3 ", "mlx5_0"), Some(3));
        assert_eq!(parse_numa_override("mlx5_0:1", "rxe0"), None);
        assert_eq!(parse_numa_override("rxe0:x,rxe0", "rxe0"), None);
        assert_eq!(parse_numa_override("", "rxe0"), None);
    }

    #[test]
    fn missing_device_has_no_numa_node() {
        assert_eq!(numa_node_of("no-such-device-here"), None);
    }

    #[test]
    fn listing_devices_never_fails_without_rdma() {
        // On a host without RDMA support the list is empty, not an error.
        let list = devices().expect("listing devices");
        for d in &list {
            assert!(!d.name.is_empty());
        }
    }
}
