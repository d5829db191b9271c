//! Heap paths that need a real device and crate internals (run in the Soft-RoCE VM): a chunk or
//! registered buffer whose deregistration the device refuses must stay mapped (leaked), never be
//! unmapped while still registered. rxe refuses `ibv_dereg_mr` while a memory window is bound.

use crate::heap::{chunk_of, mr_and_access_of, Heap};
use crate::transfer::{Connection, Options};
use crate::verbs::{leaked_mappings, Access, Context, Mw, Pd, RegisteredBuf, SendOp};

/// Whether every page of `[base, base+len)` is mapped (mincore fails with ENOMEM otherwise).
fn mapped(base: usize, len: usize) -> bool {
    let mut v = vec![0u8; len.div_ceil(4096)];
    // SAFETY: mincore only inspects the page tables; `v` has one byte per page.
    unsafe { libc::mincore(base as *mut libc::c_void, len, v.as_mut_ptr()) == 0 }
}

/// Binds a type 2 window over `[addr, addr+len)` of `mr` through `conn`.
fn bind_window(conn: &Connection, pd: &Pd, mr: *mut rdma_sys::ibv_mr, addr: u64, len: u64) -> Mw {
    let mw = Mw::new(pd).unwrap();
    let op =
        SendOp::BindMw { mw: mw.as_raw(), rkey: mw.next_rkey(), mr, addr, len, access: Access::REMOTE_WRITE.bits() };
    // SAFETY: a bind touches no local memory.
    let id = unsafe { conn.submit_control(op) }.unwrap();
    conn.wait(id).unwrap();
    mw
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_chunk_the_device_will_not_deregister_stays_mapped() {
    let pd = Pd::new(&Context::open_default().expect("an RDMA device")).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE | Access::MW_BIND).build().unwrap();
    let (a, _b) = Connection::pair(&pd, &Options::default()).unwrap();
    let buf = heap.alloc(4096).unwrap();
    let (mr, _) = mr_and_access_of(buf.as_ptr(), &pd).unwrap();
    let (base, len) = chunk_of(buf.as_ptr()).unwrap();
    let mw = bind_window(&a, &pd, mr, buf.addr(), 4096);
    let before = leaked_mappings();
    drop((buf, heap)); // teardown: ibv_dereg_mr fails while the window is bound
    assert_eq!(leaked_mappings(), before + 1, "the chunk was counted as leaked");
    assert!(mapped(base, len), "a chunk still registered was unmapped");
    assert!(chunk_of(base as *const u8).is_none(), "the chunk left the page map");
    drop(mw);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_registered_buffer_the_device_will_not_deregister_stays_mapped() {
    let pd = Pd::new(&Context::open_default().expect("an RDMA device")).unwrap();
    let (a, _b) = Connection::pair(&pd, &Options::default()).unwrap();
    let buf = RegisteredBuf::with_any_access(&pd, 8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::MW_BIND)
        .unwrap();
    let (addr, len) = (buf.as_ptr() as usize, buf.len());
    let mw = bind_window(&a, &pd, buf.mr().as_raw(), addr as u64, len as u64);
    let before = leaked_mappings();
    drop(buf);
    assert_eq!(leaked_mappings(), before + 1);
    assert!(mapped(addr, len), "a buffer still registered was unmapped");
    drop(mw);
}

/// Registration on first use: a failed `ibv_reg_mr` (injected) fails the operation with
/// `Error::Registration`, registers nothing, and the next use of the same chunk registers it.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_failed_first_use_is_a_typed_error_and_the_next_use_registers() {
    use crate::transfer::QpOptions;
    let ctx = Context::open_default().expect("an RDMA device");
    let (pd1, pd2) = (Pd::new(&ctx).unwrap(), Pd::new(&ctx).unwrap());
    let heap = Heap::builder().bind(&pd1).bind(&pd2).register_on_first_use(true).build().unwrap();
    let target = Heap::builder().bind(&pd2).access(Access::ALL_REMOTE).build().unwrap();
    let dst = target.alloc(4096).unwrap().expose().unwrap();
    let opts =
        Options { qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() }, ..Default::default() };
    let (a, _b) = Connection::pair(&pd2, &opts).unwrap();
    let mut src = heap.alloc(4096).unwrap();
    src.fill(0x5A);
    crate::heap::lazy::FAIL_NEXT.store(libc::ENOMEM, std::sync::atomic::Ordering::Relaxed);
    match a.write(&src, &dst.remote(), 0) {
        Err(crate::Error::Registration { errno, .. }) => assert_eq!(errno, libc::ENOMEM),
        other => panic!("expected Error::Registration, got {other:?}"),
    }
    let failed = heap.stats();
    assert_eq!(failed.registration_failures, 1);
    assert_eq!((failed.registered_bytes[1], failed.first_use_registrations), (0, 0), "nothing registered with pd2");
    a.write(&src, &dst.remote(), 0).expect("the next use registers the chunk");
    assert!(dst.to_vec().iter().all(|&x| x == 0x5A), "the bytes arrived");
    let used = heap.stats();
    assert_eq!(used.first_use_registrations, 1);
    assert_eq!(used.registered_bytes[1], chunk_of(src.as_ptr()).unwrap().1 as u64);
}
