//! RDMA CM setup's own tests: a malformed request, secrets refused.

use super::*;

/// A request with malformed private data fails that accept only (its id and channel go
/// in order, the peer is rejected) and the listener accepts the next one.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_malformed_request_fails_only_its_accept() {
    let ip = std::env::var("MRALLOC_CM_ADDR").expect("MRALLOC_CM_ADDR (scripts/softroce sets it)");
    let pd = Pd::new(&Options::default().open_device().unwrap()).unwrap();
    let port = 40000 + (std::process::id() % 20000) as u16;
    let l = CmListener::bind((ip.as_str(), port), &pd, Options::default()).unwrap();
    let (ip2, pd2) = (ip.clone(), pd.clone());
    let client = std::thread::spawn(move || {
        let bad = [200u8, 1, 2]; // no rights byte: an older peer's length (200 bytes claimed)
        let r =
            Connection::connect_cm_framed((ip2.as_str(), port), &pd2, Options::default(), false, |_, _| bad.to_vec());
        assert!(r.is_err(), "a rejected request");
        let c = Connection::connect_cm_with((ip2.as_str(), port), &pd2, Options::default(), b"fine");
        c.unwrap()
    });
    let first = l.accept();
    assert!(matches!(first, Err(Error::Protocol(_))), "{:?}", first.err());
    let second = l.accept_with(b"ok").unwrap();
    assert_eq!(second.peer_blob(), b"fine");
    assert_eq!(client.join().unwrap().peer_blob(), b"ok");
}

#[test]
fn secrets_are_refused() {
    assert!(check_no_secret(&Options::default()).is_ok());
    let secret = Some(crate::transfer::Secret::new("k").unwrap());
    assert!(matches!(
        check_no_secret(&Options {
            setup: crate::transfer::SetupOptions { secret, ..Default::default() },
            ..Options::default()
        }),
        Err(Error::InvalidArgument(_))
    ));
}
