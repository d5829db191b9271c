//! NUMA placement of chunks through the raw `mbind` / `move_pages` system calls.
//!
//! (`libnuma-sys` does not build on stable Rust; these calls need nothing beyond libc.)

use crate::error::{Error, Result};

const MPOL_BIND: libc::c_ulong = 2;
/// Bits in our node mask (nodes 0..64).
const MASK_BITS: u32 = 64;

/// Where a heap's chunks are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NumaPolicy {
    /// On the NUMA node of the first bound device, when it reports one; otherwise unbound (a
    /// `tracing` event says so).
    #[default]
    DeviceLocal,
    /// On this node.
    Node(u32),
    /// Wherever the kernel's default policy puts them.
    None,
}

/// The NUMA nodes the kernel reports online (`/sys/devices/system/node/online`, e.g. `0-1`).
pub fn online_nodes() -> Vec<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/node/online").unwrap_or_else(|_| "0".into());
    parse_node_list(&text)
}

pub(crate) fn parse_node_list(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.trim().parse::<u32>().ok()),
        }
    }
    out
}

/// Checks that `node` can be bound to.
pub(crate) fn validate(node: u32) -> Result<()> {
    let nodes = online_nodes();
    if node >= MASK_BITS || !nodes.contains(&node) {
        return Err(Error::InvalidArgument(format!("NUMA node {node} is not online (online nodes: {nodes:?})")));
    }
    Ok(())
}

/// Binds `[base, base+len)` to `node` (`MPOL_BIND`). Must run before the pages are touched.
/// Returns the errno on failure. Allocation-free: safe inside extent hooks.
pub(crate) fn bind(base: usize, len: usize, node: u32) -> Result<(), i32> {
    if node >= MASK_BITS {
        return Err(libc::EINVAL);
    }
    let mask: u64 = 1 << node;
    // SAFETY: mbind reads MASK_BITS bits from `mask` (maxnode counts one extra, as numactl
    // passes it); the range is a mapping the caller owns.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            base as *mut libc::c_void,
            len,
            MPOL_BIND,
            &mask as *const u64,
            libc::c_ulong::from(MASK_BITS + 1),
            0 as libc::c_uint,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(crate::heap::chunk::errno())
    }
}

/// The node each page holding `addrs` is on (`move_pages` in query mode). Negative values are
/// errnos (e.g. `-ENOENT` for a page not yet faulted in).
pub fn nodes_of_pages(addrs: &[*const u8]) -> Result<Vec<i32>> {
    let pages: Vec<*const libc::c_void> = addrs.iter().map(|&p| p.cast()).collect();
    let mut status = vec![0i32; pages.len()];
    // SAFETY: query mode (nodes = NULL) only writes `status`, which has one slot per page.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_int,
            pages.len() as libc::c_ulong,
            pages.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if rc != 0 {
        return Err(Error::Io { what: "move_pages (query)".into(), source: std::io::Error::last_os_error() });
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists() {
        assert_eq!(parse_node_list("0\n"), vec![0]);
        assert_eq!(parse_node_list("0-1"), vec![0, 1]);
        assert_eq!(parse_node_list("0,2-4\n"), vec![0, 2, 3, 4]);
        assert_eq!(parse_node_list(""), Vec::<u32>::new());
    }

    #[test]
    fn bind_to_node_zero_and_query() {
        let len = 1 << 21;
        let base = crate::heap::chunk::map(len, 0).unwrap();
        bind(base, len, 0).expect("mbind to node 0");
        // SAFETY: the mapping is ours and writable.
        unsafe { std::ptr::write_bytes(base as *mut u8, 1, 4096) };
        let nodes = nodes_of_pages(&[base as *const u8]).unwrap();
        assert_eq!(nodes, vec![0]);
        crate::heap::chunk::unmap(base, len);
        assert!(validate(63).is_err());
        assert!(validate(0).is_ok());
    }
}
