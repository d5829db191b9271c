//! What the rails device tests share: rail groups over loopback pairs on one device.

use mralloc::heap::{Exposed, Heap};
use mralloc::transfer::{Connection, RailOptions, Rails};
use mralloc::verbs::{Access, Context, Pd};
use mralloc::RemoteDesc;

use super::{open, rights};

/// The rights the groups' QPs grant the peer.
pub const RW: Access = Access::REMOTE_WRITE.union(Access::REMOTE_READ);

/// Two rail groups of `n` rails joined to each other: `ours[i]` and `theirs[i]` are the ends
/// of one loopback pair.
pub fn groups(pd: &Pd, opts: &RailOptions, n: usize) -> (Rails, Rails) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (x, y) = Connection::pair(pd, &opts.conn).unwrap();
        a.push(x);
        b.push(y);
    }
    (Rails::new(a, opts.clone()).unwrap(), Rails::new(b, opts.clone()).unwrap())
}

/// A PD on the test device, a heap bound to it with every remote right, and rail options with
/// `slice` and `window` whose QPs grant WRITE and READ.
pub fn setup(slice: usize, window: usize) -> (Pd, Heap, RailOptions) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    let opts = RailOptions { conn: rights(RW), slice, window, ..RailOptions::default() };
    (pd, heap, opts)
}

/// `len` zeroed bytes of `heap`, exposed, and their descriptor.
pub fn inbox(heap: &Heap, len: usize) -> (Exposed, RemoteDesc) {
    let x = heap.alloc(len).unwrap().expose().unwrap();
    x.write_from(0, &vec![0; len]).unwrap();
    let d = x.desc().unwrap();
    (x, d)
}

/// A second Soft-RoCE device, on a veth pair of its own with an IPv4 address (a RoCE v2 GID):
/// deleted on drop, unless a test of this process leaked something of it on purpose
/// ([`ExtraDevice::leaked`]): `rdma link delete` waits for every user of the device to go.
pub struct ExtraDevice;

pub const EXTRA: &str = "mrrail1";

/// Whether a test of this process leaked resources of the extra device.
static LEAKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl ExtraDevice {
    /// The device, made now, or the one a test of this process left behind.
    pub fn add() -> ExtraDevice {
        if LEAKED.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(std::path::Path::new("/sys/class/infiniband").join(EXTRA).exists(), "{EXTRA} is gone");
            return ExtraDevice;
        }
        let run = |cmd: &str, args: &[&str]| {
            let st = std::process::Command::new(cmd).args(args).status().unwrap();
            assert!(st.success(), "{cmd} {args:?}: {st}");
        };
        let _ = std::process::Command::new("rdma").args(["link", "delete", EXTRA]).output();
        let _ = std::process::Command::new("ip").args(["link", "del", "mrrveth0"]).output();
        run("ip", &["link", "add", "mrrveth0", "type", "veth", "peer", "name", "mrrveth1"]);
        run("ip", &["addr", "add", "10.79.0.1/24", "dev", "mrrveth0"]);
        run("ip", &["link", "set", "mrrveth0", "up"]);
        run("ip", &["link", "set", "mrrveth1", "up"]);
        run("rdma", &["link", "add", EXTRA, "type", "rxe", "netdev", "mrrveth0"]);
        ExtraDevice
    }

    /// Something of the device is leaked for good (a forgotten grant): it stays for the rest
    /// of the process.
    pub fn leaked() {
        LEAKED.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for ExtraDevice {
    fn drop(&mut self) {
        if LEAKED.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let _ = std::process::Command::new("rdma").args(["link", "delete", EXTRA]).status();
        let _ = std::process::Command::new("ip").args(["link", "del", "mrrveth0"]).status();
    }
}

/// The rights a lending or granting heap needs: windows carry the remote ones.
pub const LENDER: Access = Access::LOCAL_WRITE.union(Access::MW_BIND);

/// Two devices (the test device and the extra one), a PD on each, and rail options whose QPs
/// grant WRITE and READ, with 64 KiB slices.
pub struct Two {
    pub pds: [Pd; 2],
    pub opts: RailOptions,
    /// Last: the device goes once nothing of it is left (`rdma link delete` waits for that).
    _extra: ExtraDevice,
}

pub fn two() -> Two {
    let extra = ExtraDevice::add();
    let pds = [Pd::new(&open()).unwrap(), Pd::new(&Context::open(EXTRA).unwrap()).unwrap()];
    let opts = RailOptions { conn: rights(RW), slice: 64 << 10, ..RailOptions::default() };
    Two { pds, opts, _extra: extra }
}

impl Two {
    /// A heap bound to both devices.
    pub fn heap(&self, access: Access) -> Heap {
        Heap::builder().bind(&self.pds[0]).bind(&self.pds[1]).access(access).build().unwrap()
    }
}
