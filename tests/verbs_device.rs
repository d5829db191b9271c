//! Verbs core against a real RDMA device (Soft-RoCE in the VM). Run by `scripts/test`.

mod common;

use common::*;
use mralloc::verbs::{
    Access, ConnectOptions, Context, Cq, LinkLayer, Pd, PortState, Qp, QpState, RegisteredBuf, RemoteAddr, SendOp,
    SendWr, WcOpcode, WcStatus,
};
use mralloc::Error;

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_open_and_describe() {
    let ctx = open();
    assert_eq!(ctx.name(), device_name());
    let port = ctx.first_active_port().expect("an ACTIVE port");
    let info = ctx.port(port).unwrap();
    assert_eq!(info.state, PortState::Active);
    println!("{} port {port}: {:?}", ctx.name(), info);
    let table = ctx.gid_table(port).unwrap();
    assert!(!table.is_empty(), "GID table is empty");
    for e in &table {
        println!("  gid[{}] = {} ({:?})", e.index, e.gid, e.kind);
    }
    let idx = ctx.default_gid_index(port).unwrap();
    let gid = ctx.gid(port, idx).unwrap();
    assert!(!gid.is_zero());
    if info.link_layer == LinkLayer::Ethernet && std::env::var("MRALLOC_IN_VM").is_ok() {
        assert_eq!(gid.to_string(), "::ffff:10.77.0.1", "the VM's rxe0 GID");
        assert_eq!(ctx.numa_node(), None, "rxe is virtual: no NUMA node");
    }
    let listed = mralloc::verbs::devices().unwrap();
    assert!(listed.iter().any(|d| d.name == ctx.name()), "{listed:?}");
    // Bad indices are typed errors, not panics.
    assert!(matches!(ctx.port(0), Err(Error::NoSuchIndex { what: "port", .. })));
    assert!(matches!(ctx.gid(port, 100_000), Err(Error::NoSuchIndex { what: "GID index", .. })));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_open_missing_names_available() {
    let err = Context::open("no-such-hca9").unwrap_err();
    match &err {
        Error::NoSuchDevice { name, available } => {
            assert_eq!(name, "no-such-hca9");
            assert!(available.contains(&device_name()), "{available:?}");
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    }
    assert!(err.to_string().contains(&device_name()), "{err}");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_register_2mib() {
    let ctx = open();
    let pd = Pd::new(&ctx).unwrap();
    // A buffer that lends references refuses rights under which a peer could write it.
    for writable in [Access::REMOTE_WRITE, Access::REMOTE_ATOMIC, Access::MW_BIND] {
        let r = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE | writable);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{writable:?}: {r:?}");
    }
    let mut buf = RegisteredBuf::new(&pd, 2 << 20, Access::LOCAL_WRITE | Access::REMOTE_READ).unwrap();
    assert_eq!(buf.len(), 2 << 20);
    assert_eq!(buf.mr().len(), 2 << 20);
    assert_eq!(buf.mr().addr(), buf.as_ptr() as u64);
    assert_ne!(buf.mr().lkey(), 0);
    buf.fill(0xa5);
    assert!(buf.mr().sge(0..(2 << 20) + 1).is_err(), "out-of-range SGE must be refused");
    // Zero-length registration is refused before reaching the driver.
    // SAFETY: nothing is registered: the call fails on the length check.
    let zero = unsafe { mralloc::verbs::Mr::register(&pd, buf.as_mut_ptr(), 0, Access::LOCAL_WRITE) };
    assert!(matches!(zero, Err(Error::InvalidArgument(_))));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_write_1mib_and_read_4kib() {
    let lb = loopback();
    const N: usize = 1 << 20;
    let want = pattern(1, N);
    let mut src = RegisteredBuf::new(&lb.pd, N, Access::LOCAL_WRITE).unwrap();
    let dst = RegisteredBuf::new(&lb.pd, N, Access::LOCAL_WRITE)
        .unwrap()
        .expose(Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    src.copy_from_slice(&want);

    let sge = [src.sge(0..N).unwrap()];
    let remote = dst.mr().remote(0).unwrap();
    // SAFETY: src and dst live until after the completion is polled; the CPU does not touch them
    // meanwhile.
    unsafe { lb.a.post_send(&[SendWr::new(7, &sge, SendOp::Write(remote))]).unwrap() };
    let wc = lb.cq_a.next(WAIT).unwrap();
    wc.ok().unwrap();
    assert_eq!((wc.wr_id(), wc.opcode()), (7, WcOpcode::RdmaWrite));
    assert_bytes_eq(&dst.to_vec(), &want, "RDMA WRITE 1 MiB");

    // READ 4 KiB from an unaligned offset of dst back into a fresh buffer.
    let back = RegisteredBuf::new(&lb.pd, 4096, Access::LOCAL_WRITE).unwrap();
    let sge = [back.sge(0..4096).unwrap()];
    // SAFETY: as above.
    unsafe { lb.a.post_send(&[SendWr::new(8, &sge, SendOp::Read(remote.offset(12345)))]).unwrap() };
    let wc = lb.cq_a.next(WAIT).unwrap();
    wc.ok().unwrap();
    assert_eq!((wc.wr_id(), wc.opcode(), wc.byte_len()), (8, WcOpcode::RdmaRead, 4096));
    assert_bytes_eq(&back, &want[12345..12345 + 4096], "RDMA READ 4 KiB");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_send_recv_4kib_and_imm() {
    let lb = loopback();
    let want = pattern(2, 4096);
    let mut src = RegisteredBuf::new(&lb.pd, 4096, Access::LOCAL_WRITE).unwrap();
    let rbuf = RegisteredBuf::new(&lb.pd, 8192, Access::LOCAL_WRITE).unwrap();
    src.copy_from_slice(&want);
    let rsge = [rbuf.sge(0..4096).unwrap()];
    let rsge2 = [rbuf.sge(4096..8192).unwrap()];
    // SAFETY: rbuf outlives both receives, which are reaped below before it is read.
    unsafe {
        lb.b.post_recv(100, &rsge).unwrap();
        lb.b.post_recv(101, &rsge2).unwrap();
    }
    let sge = [src.sge(0..4096).unwrap()];
    // SAFETY: src lives until the completions are polled.
    unsafe {
        lb.a.post_send(&[
            SendWr::new(1, &sge, SendOp::Send),
            SendWr::new(2, &sge[..], SendOp::SendWithImm(0xfeed_beef)),
        ])
        .unwrap()
    };
    let mut got = Vec::new();
    while got.len() < 2 {
        let wc = lb.cq_b.next(WAIT).unwrap();
        wc.ok().unwrap();
        got.push((wc.wr_id(), wc.opcode(), wc.byte_len(), wc.imm()));
    }
    assert_eq!(got, vec![(100, WcOpcode::Recv, 4096, None), (101, WcOpcode::Recv, 4096, Some(0xfeed_beef))]);
    for _ in 0..2 {
        lb.cq_a.next(WAIT).unwrap().ok().unwrap();
    }
    assert_bytes_eq(&rbuf[..4096], &want, "SEND/RECV 4 KiB");
    assert_bytes_eq(&rbuf[4096..], &want, "SEND with imm 4 KiB");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_wrong_rkey_is_remote_access_error_then_new_qp_works() {
    let ctx = open();
    let pd = Pd::new(&ctx).unwrap();
    let lb = loopback_in(&ctx, &pd);
    let src = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE).unwrap();
    let dst = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE).unwrap().expose(Access::REMOTE_WRITE).unwrap();
    let sge = [src.sge(0..64).unwrap()];
    let bad = RemoteAddr { addr: dst.mr().addr(), rkey: dst.mr().rkey() ^ 0x5a5a_0000 };
    // SAFETY: both buffers outlive the completion.
    unsafe { lb.a.post_send(&[SendWr::new(9, &sge, SendOp::Write(bad))]).unwrap() };
    let wc = lb.cq_a.next(WAIT).unwrap();
    let err = wc.ok().unwrap_err();
    assert_eq!(err.wc_status(), Some(WcStatus::RemAccessErr), "{err}");
    assert!(err.to_string().contains("REM_ACCESS_ERR"), "{err}");
    assert!(matches!(err, Error::WorkCompletion { wr_id: 9, .. }));
    assert_eq!(lb.a.state().unwrap(), QpState::Error);

    // The process keeps working: a new pair in the same PD moves data with the right key.
    let lb2 = loopback_in(&ctx, &pd);
    let mut src2 = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE).unwrap();
    src2[..64].copy_from_slice(&pattern(3, 64));
    let sge = [src2.sge(0..64).unwrap()];
    // SAFETY: as above.
    unsafe { lb2.a.post_send(&[SendWr::new(10, &sge, SendOp::Write(dst.mr().remote(0).unwrap()))]).unwrap() };
    lb2.cq_a.next(WAIT).unwrap().ok().unwrap();
    let dst = dst.revoke().unwrap();
    assert_bytes_eq(&dst[..64], &pattern(3, 64), "write after error");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_atomics_and_bad_atomic_arguments() {
    let lb = loopback();
    let word = RegisteredBuf::new(&lb.pd, 8, Access::LOCAL_WRITE).unwrap().expose(Access::REMOTE_ATOMIC).unwrap();
    let old = RegisteredBuf::new(&lb.pd, 8, Access::LOCAL_WRITE).unwrap();
    let sge = [old.sge(0..8).unwrap()];
    let remote = word.mr().remote(0).unwrap();
    for i in 0..5u64 {
        // SAFETY: both buffers outlive the completion, polled before the next post.
        unsafe { lb.a.post_send(&[SendWr::new(i, &sge, SendOp::FetchAdd { remote, add: 10 })]).unwrap() };
        lb.cq_a.next(WAIT).unwrap().ok().unwrap();
        assert_eq!(u64::from_ne_bytes(old[..8].try_into().unwrap()), i * 10);
    }
    // SAFETY: as above.
    unsafe { lb.a.post_send(&[SendWr::new(9, &sge, SendOp::CompareSwap { remote, compare: 50, swap: 7 })]).unwrap() };
    lb.cq_a.next(WAIT).unwrap().ok().unwrap();
    assert_eq!(u64::from_ne_bytes(word.to_vec()[..8].try_into().unwrap()), 7);
    // Misaligned remote word: refused before posting.
    // SAFETY: nothing is posted: validation fails first.
    let r = unsafe { lb.a.post_send(&[SendWr::new(1, &sge, SendOp::FetchAdd { remote: remote.offset(1), add: 1 })]) };
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_drop_order_never_frees_parents_first() {
    // Drop the parents first: the children keep them alive, and everything is released at the
    // end without errors (the next allocation of the same objects works).
    for _ in 0..3 {
        let ctx = open();
        let pd = Pd::new(&ctx).unwrap();
        let cq = Cq::new(&ctx, 16).unwrap();
        let qp = Qp::builder(&pd, &cq, &cq).build().unwrap();
        let buf = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE).unwrap();
        drop(ctx);
        drop(pd);
        drop(cq);
        assert_eq!(qp.state().unwrap(), QpState::Init);
        let self_ep = qp.endpoint();
        qp.connect(&self_ep, &ConnectOptions::default()).unwrap();
        assert_eq!(qp.state().unwrap(), QpState::ReadyToSend);
        drop(qp);
        assert_ne!(buf.mr().lkey(), 0);
        drop(buf);
    }
}
