use super::*;
use crate::verbs::Mtu;
use proptest::prelude::*;

fn gid(n: u8) -> Gid {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12] = 10;
    g[15] = n;
    Gid::from_bytes(g)
}

fn two() -> RemoteDesc {
    RemoteDesc::new(
        0x7f00_0000_1000,
        4096,
        &[DeviceKey { gid: gid(1), rkey: 0x11 }, DeviceKey { gid: gid(2), rkey: 0x22 }],
    )
    .unwrap()
}

fn fault(r: Result<RemoteDesc>) -> DescFault {
    match r {
        Err(Error::MalformedDescriptor(f)) => f,
        other => panic!("expected MalformedDescriptor, got {other:?}"),
    }
}

#[test]
fn round_trip_and_picking_a_device() {
    let d = two();
    assert_eq!(d.encoded_len(), 18 + 2 * 20);
    assert_eq!(RemoteDesc::from_bytes(&d.to_vec()).unwrap(), d);
    assert_eq!(d.for_gid(&gid(2)), Some(RemoteBuf { addr: d.addr(), len: 4096, rkey: 0x22 }));
    assert_eq!(d.for_gid(&gid(3)), None);
    let peer = Endpoint { qpn: 1, psn: 1, gid: gid(1), lid: 0, mtu: Mtu::Mtu1024 };
    assert_eq!(d.for_peer(&peer).unwrap().rkey, 0x11);
    let stranger = Endpoint { gid: gid(9), ..peer };
    assert!(
        matches!(d.for_peer(&stranger), Err(Error::NoKeyForDevice { gid: g, ref have }) if g == gid(9) && have.len() == 2)
    );
}

#[test]
fn slicing_keeps_every_key() {
    let d = two();
    let s = d.slice(100..300).unwrap();
    assert_eq!((s.addr(), s.len()), (d.addr() + 100, 200));
    assert_eq!(s.keys(), d.keys());
    assert!(matches!(d.slice(100..4097), Err(Error::OutOfBounds { .. })));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = d.slice(300..100);
    assert!(matches!(reversed, Err(Error::OutOfBounds { .. })));
    assert_eq!(d.slice(4096..4096).unwrap().len(), 0);
}

#[test]
fn every_malformed_input_has_its_fault() {
    let good = two().to_vec();
    assert_eq!(fault(RemoteDesc::from_bytes(&[])), DescFault::Truncated { got: 0, need: 18 });
    let mut v = good.clone();
    v[0] = 2;
    assert_eq!(fault(RemoteDesc::from_bytes(&v)), DescFault::Version(2));
    assert_eq!(fault(RemoteDesc::from_bytes(&good[..10])), DescFault::Truncated { got: 10, need: 18 });
    assert_eq!(fault(RemoteDesc::from_bytes(&good[..57])), DescFault::Truncated { got: 57, need: 58 });
    let mut v = good.clone();
    v.push(0);
    assert_eq!(fault(RemoteDesc::from_bytes(&v)), DescFault::Trailing(1));
    let mut v = good.clone();
    v[1] = 0;
    assert_eq!(fault(RemoteDesc::from_bytes(&v)), DescFault::NoKeys);
    let mut v = good.clone();
    v[1] = 5;
    assert_eq!(fault(RemoteDesc::from_bytes(&v)), DescFault::TooMany(5));
    // The second entry's GID made equal to the first's.
    let mut v = good.clone();
    v.copy_within(18..34, 38);
    assert_eq!(fault(RemoteDesc::from_bytes(&v)), DescFault::DuplicateDevice(gid(1)));
    let mut v = good.clone();
    v[18..34].fill(0);
    assert_eq!(fault(RemoteDesc::from_bytes(&v)), DescFault::ZeroGid);
    let mut v = good.clone();
    v[2..10].copy_from_slice(&(u64::MAX - 100).to_be_bytes());
    assert_eq!(fault(RemoteDesc::from_bytes(&v)), DescFault::Wraps { addr: u64::MAX - 100, len: 4096 });
    let five = [1, 2, 3, 4, 5].map(|n| DeviceKey { gid: gid(n), rkey: 1 });
    assert_eq!(fault(RemoteDesc::new(0, 1, &five)), DescFault::TooMany(5));
    assert!(RemoteDesc::new(0, 1, &five[..4]).is_ok());
}

fn any_desc() -> impl Strategy<Value = RemoteDesc> {
    (any::<u64>(), any::<u64>(), proptest::collection::btree_map(1u8..=255, any::<u32>(), 1..=4)).prop_map(
        |(addr, len, keys)| {
            let len = len.min(u64::MAX - addr);
            let keys: Vec<DeviceKey> = keys.into_iter().map(|(g, rkey)| DeviceKey { gid: gid(g), rkey }).collect();
            RemoteDesc::new(addr, len, &keys).unwrap()
        },
    )
}

proptest! {
    #[test]
    fn encoding_round_trips(d in any_desc()) {
        let bytes = d.to_vec();
        prop_assert_eq!(bytes.len(), d.encoded_len());
        prop_assert_eq!(RemoteDesc::from_bytes(&bytes).unwrap(), d);
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
        if let Ok(d) = RemoteDesc::from_bytes(&bytes) {
            // Whatever decodes re-encodes to the same bytes: one spelling per descriptor.
            prop_assert_eq!(d.to_vec(), bytes);
        }
    }

    /// Random entries behind a valid version and count reach the checks past the header.
    #[test]
    fn random_entries_never_panic(count in 0u8..7, rest in proptest::collection::vec(any::<u8>(), 0..120)) {
        let mut b = vec![RemoteDesc::VERSION, count];
        b.extend_from_slice(&rest);
        if let Ok(d) = RemoteDesc::from_bytes(&b) {
            prop_assert_eq!(d.to_vec(), b);
        }
    }
}
