//! The connection message's encoder and parser: round trips, and every malformed input refused.

use super::*;
use crate::verbs::{Gid, Mtu};
use proptest::prelude::*;

fn ep() -> Endpoint {
    Endpoint { qpn: 7, psn: 9, gid: Gid::from_bytes([1; 16]), lid: 0, mtu: Mtu::Mtu1024 }
}

fn samples() -> Vec<Message> {
    let mut hello = Message::new(Kind::Hello, Some(ep()), b"remote-buf".to_vec());
    hello.mac = [0xAB; MAC_LEN];
    hello.control = Some(Endpoint { qpn: 8, ..ep() });
    hello.rights = Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let mut challenge = Message::new(Kind::Challenge, None, Vec::new());
    challenge.nonce = [3; NONCE_LEN];
    let mut proof = Message::new(Kind::Proof, None, Vec::new());
    proof.nonce = [4; NONCE_LEN];
    proof.mac = [5; MAC_LEN];
    vec![
        hello,
        Message::new(Kind::Welcome, Some(ep()), vec![]),
        Message::new(Kind::Ready, Some(ep()), vec![]),
        Message::new(Kind::Ready, None, vec![]),
        challenge,
        proof,
        Message::refused(Refusal::SecretRequired),
        Message::refused(Refusal::NoSecret),
        Message::refused(Refusal::WrongSecret),
    ]
}

#[test]
fn round_trip_every_kind() {
    for m in samples() {
        let b = m.encode().unwrap();
        assert_eq!(b.len(), HEADER + m.blob.len());
        assert_eq!(Message::decode(&b).unwrap(), m);
        assert_eq!(Message::recv(&mut &b[..]).unwrap(), m);
    }
}

#[test]
fn rejects_bad_input() {
    let good = Message::new(Kind::Welcome, Some(ep()), vec![]).encode().unwrap();
    let mut b = good.clone();
    b[5] = 9;
    assert!(Message::decode(&b).unwrap_err().to_string().contains("version 9"));
    let mut b = good.clone();
    b[5] = 2; // a version-2 peer is told which version this build speaks
    assert!(Message::decode(&b).unwrap_err().to_string().contains(&format!("this build speaks {VERSION}")));
    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(Message::decode(&b), Err(Error::Protocol(_))));
    let mut b = good.clone();
    b[AT_LEN..AT_LEN + 4].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(Message::decode(&b).unwrap_err().to_string().contains("exceeds"));
    assert!(Message::recv(&mut &good[..10]).is_err());
    let big = Message::new(Kind::Hello, Some(ep()), vec![0; MAX_BLOB + 1]);
    assert!(big.encode().is_err());
}

#[test]
fn rejects_fields_a_kind_does_not_use() {
    let shape = |m: &Message| m.encode().unwrap_err();
    assert!(matches!(shape(&Message::new(Kind::Hello, None, vec![])), Error::InvalidArgument(_)));
    assert!(matches!(shape(&Message::new(Kind::Challenge, Some(ep()), vec![])), Error::InvalidArgument(_)));
    assert!(matches!(shape(&Message::new(Kind::Ready, None, vec![1])), Error::InvalidArgument(_)));
    assert!(matches!(shape(&Message::new(Kind::Refused, None, vec![])), Error::InvalidArgument(_)));
    let ready = Message { control: Some(ep()), ..Message::new(Kind::Ready, Some(ep()), vec![]) };
    assert!(matches!(shape(&ready), Error::InvalidArgument(_)));
    // The same rules on the wire: a Proof with a blob, a Hello with a code, a zeroed Hello
    // endpoint, an unknown code.
    let proof = Message::new(Kind::Proof, None, vec![]).encode().unwrap();
    let mut b = proof.clone();
    b[AT_LEN + 3] = 1;
    b.push(0);
    assert!(Message::decode(&b).unwrap_err().to_string().contains("blob"));
    let hello = Message::new(Kind::Hello, Some(ep()), vec![]).encode().unwrap();
    let mut b = hello.clone();
    b[7] = 3;
    assert!(matches!(Message::decode(&b), Err(Error::Protocol(_))));
    let mut b = hello.clone();
    b[AT_ENDPOINT..AT_CONTROL].fill(0);
    assert!(Message::decode(&b).unwrap_err().to_string().contains("without an endpoint"));
    let mut b = Message::refused(Refusal::NoSecret).encode().unwrap();
    b[7] = 200;
    assert!(Message::decode(&b).unwrap_err().to_string().contains("refusal code 200"));
}

#[test]
fn rights_travel_and_a_garbled_or_misplaced_rights_byte_is_refused() {
    let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    for rights in [Access::NONE, Access::REMOTE_WRITE, Access::REMOTE_READ, Access::REMOTE_ATOMIC, all] {
        let m = Message { rights, ..Message::new(Kind::Welcome, Some(ep()), vec![]) };
        let b = m.encode().unwrap();
        assert_eq!(b[AT_RIGHTS], encode_rights(rights));
        assert_eq!(Message::decode(&b).unwrap().rights, rights);
    }
    assert_eq!(encode_rights(all), 7);
    let good = Message::new(Kind::Hello, Some(ep()), vec![]).encode().unwrap();
    for garbled in [8u8, 0x10, 0x80, 0xff] {
        let mut b = good.clone();
        b[AT_RIGHTS] = garbled;
        let e = Message::decode(&b).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("rights byte"), "{garbled:#x}: {e}");
    }
    // Only Hello and Welcome carry rights.
    let mut b = Message::new(Kind::Ready, None, vec![]).encode().unwrap();
    b[AT_RIGHTS] = 1;
    assert!(Message::decode(&b).unwrap_err().to_string().contains("with rights"));
    let ready = Message { rights: Access::REMOTE_READ, ..Message::new(Kind::Ready, None, vec![]) };
    assert!(matches!(ready.encode(), Err(Error::InvalidArgument(_))));
    // A version-3 message (no rights byte: one byte shorter) is refused by its version, not
    // misread, and from a stream without waiting for a byte it will never send.
    let mut v3 = good.clone();
    v3.remove(AT_RIGHTS);
    v3[4..6].copy_from_slice(&3u16.to_be_bytes());
    let e = Message::recv(&mut &v3[..]).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("version 3"), "{e}");
    v3.push(0);
    let e = Message::decode(&v3).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("version 3"), "{e}");
}

proptest! {
    #[test]
    fn parser_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = Message::decode(&bytes);
        let _ = Message::recv(&mut &bytes[..]);
    }

    /// Arbitrary bytes behind a valid magic and version reach every later check.
    #[test]
    fn parser_is_bounded_behind_a_valid_prefix(kind in 0u8..8, code in 0u8..5, rest in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&VERSION.to_be_bytes());
        b.push(kind);
        b.push(code);
        b.extend_from_slice(&rest);
        if let Ok(m) = Message::recv(&mut &b[..]) {
            prop_assert!(m.blob.len() <= MAX_BLOB);
            prop_assert_eq!(Message::decode(&m.encode().unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn parser_survives_corrupted_valid_messages(which in 0usize..9, pos in 0usize..200, val in any::<u8>(), blob in proptest::collection::vec(any::<u8>(), 0..32)) {
        let mut m = samples().swap_remove(which);
        if matches!(m.kind, Kind::Hello | Kind::Welcome) {
            m.blob = blob;
        }
        let orig = m.encode().unwrap();
        prop_assert_eq!(&Message::decode(&orig).unwrap(), &m, "encode/decode round trip");
        let mut b = orig.clone();
        let i = pos % b.len();
        b[i] = val;
        match Message::decode(&b) {
            Ok(d) => {
                prop_assert!(d.blob.len() <= MAX_BLOB);
                // What the parser accepts is what the encoder writes: no second spelling of
                // a message, and an unchanged byte gives the original back.
                prop_assert_eq!(d.encode().unwrap(), b.clone(), "accepted bytes re-encode the same");
                if val == orig[i] {
                    prop_assert_eq!(d, m);
                }
            }
            Err(e) => prop_assert!(val != orig[i], "the original bytes were refused: {}", e),
        }
    }
}
