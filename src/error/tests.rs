use super::*;

#[test]
fn debug_shows_the_message() {
    let e = Error::NoActiveDevice { available: vec![] };
    let d = format!("{e:?}");
    assert!(d.starts_with(&e.to_string()) && d.ends_with("[Error::NoActiveDevice]"), "{d}");
}

#[test]
fn a_refused_operation_names_the_right_it_needs() {
    let refused = |op| Error::Operation { op, wr_id: 1, status: WcStatus::RemInvReqErr, vendor_err: 0 }.to_string();
    assert!(refused("RDMA WRITE").contains("REMOTE_WRITE"), "{}", refused("RDMA WRITE"));
    assert!(refused("RDMA WRITE with immediate").contains("REMOTE_WRITE"));
    assert!(refused("RDMA READ").contains("REMOTE_READ"));
    assert!(refused("fetch-and-add").contains("REMOTE_ATOMIC"));
    assert!(refused("compare-and-swap").contains("REMOTE_ATOMIC"));
    assert!(refused("SEND").contains("receive buffer"));
    let other = Error::Operation { op: "RDMA WRITE", wr_id: 1, status: WcStatus::LocLenErr, vendor_err: 0 };
    assert!(!other.to_string().contains("Hint"), "no hint where none helps: {other}");
}

#[test]
fn reg_mr_enomem_hint_names_memlock() {
    let e = Error::verbs_errno("ibv_reg_mr", libc::ENOMEM);
    let s = e.to_string();
    assert!(s.contains("ibv_reg_mr failed"), "{s}");
    assert!(s.contains("RLIMIT_MEMLOCK"), "{s}");
    assert_eq!(e.errno(), Some(libc::ENOMEM));
}

#[test]
fn no_such_device_lists_available() {
    let e = Error::NoSuchDevice { name: "mlx9".into(), available: vec!["rxe0".into(), "mlx5_0".into()] };
    assert_eq!(e.to_string(), "RDMA device \"mlx9\" not found; available devices: rxe0, mlx5_0");
    let e = Error::NoSuchDevice { name: "x".into(), available: vec![] };
    assert!(e.to_string().ends_with("available devices: none"));
}
