//! What the rails device tests share: rail groups over loopback pairs on one device.

use mralloc::heap::{Exposed, Heap};
use mralloc::transfer::{Connection, RailOptions, Rails};
use mralloc::verbs::{Access, Pd};
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
