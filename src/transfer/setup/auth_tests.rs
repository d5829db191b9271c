//! The shared-secret exchange over loopback TCP, without a device: `prepare` stands in for
//! creating a QP, and records whether it ran.

use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use super::*;
use crate::transfer::setup::wire::{block_on, Plain};
use crate::transfer::{Options, SetupOptions};
use crate::verbs::{Access, Gid, Mtu};

fn ep(qpn: u32) -> Endpoint {
    Endpoint { qpn, psn: 1, gid: Gid::from_bytes([7; 16]), lid: 0, mtu: Mtu::Mtu1024 }
}

fn secret(s: &str) -> Option<Secret> {
    Some(Secret::new(s).unwrap())
}

/// What one side of a run saw: its result (the peer's blob), and whether it prepared a QP.
#[derive(Debug)]
struct Side {
    result: Result<Vec<u8>>,
    prepared: bool,
    /// Whether the peer's control endpoint arrived.
    control: bool,
}

fn run_side(s: &mut TcpStream, is_server: bool, secret: Option<&Secret>, blob: &[u8], qpn: u32) -> Side {
    let prepared = Cell::new(false);
    let control = Cell::new(false);
    let prepare = || {
        prepared.set(true);
        Ok(((), ep(qpn), Some(ep(qpn + 100)), rights_of(qpn)))
    };
    let s = &mut Plain(s);
    let r = if is_server {
        block_on(async {
            let heard = hear(s, secret).await?;
            welcome(s, heard, prepare()?, blob.to_vec()).await
        })
    } else {
        block_on(client(s, secret, blob, prepare))
    };
    Side {
        result: r.map(|x| {
            assert_eq!(x.peer.qpn, if is_server { 1 } else { 2 }, "the peer's endpoint came through");
            assert_eq!(x.me.qpn, qpn);
            if let Some(control) = x.peer_control {
                assert_eq!(control.qpn, x.peer.qpn + 100, "the control endpoint came through");
            }
            assert_eq!(x.peer_grants, rights_of(x.peer.qpn), "the peer's rights came through");
            control.set(x.peer_control.is_some());
            x.peer_blob
        }),
        prepared: prepared.get(),
        control: control.get(),
    }
}

/// The rights the side with data QP `qpn` grants (each side its own).
fn rights_of(qpn: u32) -> Access {
    if qpn == 1 {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_WRITE | Access::REMOTE_ATOMIC
    }
}

fn stream(s: TcpStream) -> TcpStream {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// A client (QP 1, blob "client blob") and a server (QP 2, blob "server blob") over loopback.
fn run(client_secret: Option<Secret>, server_secret: Option<Secret>) -> (Side, Side) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::scope(|sc| {
        let srv = sc.spawn(|| {
            let mut s = stream(l.accept().unwrap().0);
            run_side(&mut s, true, server_secret.as_ref(), b"server blob", 2)
        });
        let mut s = stream(TcpStream::connect(addr).unwrap());
        let c = run_side(&mut s, false, client_secret.as_ref(), b"client blob", 1);
        (c, srv.join().unwrap())
    })
}

fn auth_err(side: &Side) -> AuthFailure {
    match &side.result {
        Err(Error::Authentication(f)) => *f,
        other => panic!("expected an authentication error, got {other:?}"),
    }
}

#[test]
fn same_secret_or_none_exchanges_endpoints_and_blobs() {
    for (c, s) in [(None, None), (secret("k3y-material"), secret("k3y-material"))] {
        let (c, s) = run(c, s);
        assert_eq!(c.result.unwrap(), b"server blob");
        assert_eq!(s.result.unwrap(), b"client blob");
        assert!(c.prepared && s.prepared);
        assert!(c.control && s.control, "both offered a control channel: both endpoints arrived");
    }
}

#[test]
fn wrong_secret_fails_on_both_sides_before_any_qp_or_blob() {
    let (c, s) = run(secret("one secret"), secret("another secret"));
    // The client checks the server's proof first: it prepares nothing and sends no blob.
    assert_eq!(auth_err(&c), AuthFailure::WrongSecret);
    assert!(!c.prepared, "the client prepared a QP for an unproven server");
    assert_eq!(auth_err(&s), AuthFailure::WrongSecret, "the server is told, typed");
    assert!(!s.prepared, "the server prepared a QP for an unproven client");
}

#[test]
fn a_missing_secret_on_either_side_is_typed_on_both() {
    // A stranger without the secret reaches a server that has one: no QP, no blob for it.
    let (c, s) = run(None, secret("k"));
    assert_eq!(auth_err(&s), AuthFailure::NoPeerSecret);
    assert!(!s.prepared);
    assert_eq!(auth_err(&c), AuthFailure::NoLocalSecret, "and it is told why");
    // A client that requires a secret never hands its endpoint or blob to a server without one.
    let (c, s) = run(secret("k"), None);
    assert_eq!(auth_err(&c), AuthFailure::NoPeerSecret);
    assert!(!c.prepared);
    assert_eq!(auth_err(&s), AuthFailure::NoLocalSecret);
    assert!(!s.prepared);
}

/// Records what a side writes.
struct Tap<'a> {
    s: &'a mut TcpStream,
    sent: Vec<u8>,
}

impl Read for Tap<'_> {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.s.read(b)
    }
}

impl Write for Tap<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.sent.extend_from_slice(b);
        self.s.write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.s.flush()
    }
}

#[test]
fn a_recorded_client_exchange_replayed_to_the_server_is_refused() {
    let k = secret("replay-proof");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    // A genuine exchange, with the client's bytes recorded by an eavesdropper.
    let recorded = std::thread::scope(|sc| {
        let srv = sc.spawn(|| run_side(&mut stream(l.accept().unwrap().0), true, k.as_ref(), b"server blob", 2));
        let mut s = stream(TcpStream::connect(addr).unwrap());
        let mut tap = Tap { s: &mut s, sent: Vec::new() };
        block_on(client(&mut Plain(&mut tap), k.as_ref(), b"client blob", || Ok(((), ep(1), None, rights_of(1)))))
            .unwrap();
        let sent = tap.sent;
        assert!(srv.join().unwrap().result.is_ok());
        sent
    });
    let challenge = Message::decode(&recorded[..HEADER_LEN]).unwrap();
    let hello = Message::decode(&recorded[HEADER_LEN..]).unwrap();
    assert_eq!((challenge.kind, hello.kind), (Kind::Challenge, Kind::Hello));
    // The replay: the same Challenge and Hello against a fresh server nonce.
    let s = std::thread::scope(|sc| {
        let srv = sc.spawn(|| run_side(&mut stream(l.accept().unwrap().0), true, k.as_ref(), b"server blob", 2));
        let mut s = stream(TcpStream::connect(addr).unwrap());
        challenge.send(&mut s).unwrap();
        let proof = Message::recv(&mut s).unwrap();
        assert_eq!(proof.kind, Kind::Proof);
        hello.send(&mut s).unwrap();
        let answer = Message::recv(&mut s).unwrap();
        assert_eq!(answer.refusal, Some(Refusal::WrongSecret), "the replay gets a refusal, not a Welcome");
        srv.join().unwrap()
    });
    assert_eq!(auth_err(&s), AuthFailure::WrongSecret);
    assert!(!s.prepared, "a replayed Hello got a QP prepared");
}

const HEADER_LEN: usize = crate::transfer::setup::exchange::HEADER;

#[test]
fn an_altered_welcome_is_refused_by_the_client() {
    let k = Secret::new("tamper").unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    // The blob, or the rights the server grants, changed on the way (the MAC covers both).
    let alterations: [fn(&mut Message); 2] =
        [|w| w.blob = b"rkey 0x6666".to_vec(), |w| w.rights = Access::REMOTE_WRITE | Access::REMOTE_READ];
    for alter in alterations {
        std::thread::scope(|sc| {
            // A server that holds the secret, but whose Welcome is changed on the way.
            let srv = sc.spawn(|| {
                let mut s = stream(l.accept().unwrap().0);
                let ch = Message::recv(&mut s).unwrap();
                let ns = [9u8; NONCE_LEN];
                let proof = tag(mac(&k, "server-proof", &ch.nonce, &ns, None).unwrap());
                Message { nonce: ns, mac: proof, ..Message::new(Kind::Proof, None, Vec::new()) }.send(&mut s).unwrap();
                Message::recv(&mut s).unwrap();
                let mut w = Message::new(Kind::Welcome, Some(ep(2)), b"rkey 0x1234".to_vec());
                w.rights = rights_of(2);
                w.mac = tag(mac(&k, "server-welcome", &ch.nonce, &ns, Some(&w)).unwrap());
                alter(&mut w);
                w.send(&mut s).unwrap();
                Message::recv(&mut s).unwrap()
            });
            let c = run_side(&mut stream(TcpStream::connect(addr).unwrap()), false, Some(&k), b"client blob", 1);
            assert_eq!(auth_err(&c), AuthFailure::WrongSecret);
            assert_eq!(srv.join().unwrap().refusal, Some(Refusal::WrongSecret), "the server is told");
        });
    }
}

#[test]
fn macs_bind_role_nonces_endpoints_and_blob() {
    let k = Secret::new("k").unwrap();
    let (a, b) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
    let hello = |e: u32, control: Option<u32>, blob: &[u8]| Message {
        control: control.map(ep),
        ..Message::new(Kind::Hello, Some(ep(e)), blob.to_vec())
    };
    let base = tag(mac(&k, "client-hello", &a, &b, Some(&hello(1, None, b"x"))).unwrap());
    let variants = [
        tag(mac(&k, "server-welcome", &a, &b, Some(&hello(1, None, b"x"))).unwrap()),
        tag(mac(&k, "client-hello", &b, &a, Some(&hello(1, None, b"x"))).unwrap()),
        tag(mac(&k, "client-hello", &a, &b, Some(&hello(3, None, b"x"))).unwrap()),
        tag(mac(&k, "client-hello", &a, &b, Some(&hello(1, Some(5), b"x"))).unwrap()),
        tag(mac(&k, "client-hello", &a, &b, Some(&hello(1, None, b"y"))).unwrap()),
        tag(mac(&Secret::new("K").unwrap(), "client-hello", &a, &b, Some(&hello(1, None, b"x"))).unwrap()),
    ];
    for v in variants {
        assert_ne!(v, base);
    }
    assert_ne!(nonce().unwrap(), nonce().unwrap(), "nonces are fresh");
}

#[test]
fn secrets_are_never_printed_and_never_empty() {
    let opts = Options {
        setup: SetupOptions { secret: secret("hunter2-very-secret"), ..Default::default() },
        ..Options::default()
    };
    let shown = format!("{opts:?} {:?}", opts.setup.secret);
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
    assert!(matches!(Secret::new(""), Err(Error::InvalidArgument(_))));
}
