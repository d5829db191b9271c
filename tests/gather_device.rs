//! Scatter/gather: one SEND or WRITE from a header and a payload in different allocations, one
//! receive or READ into several buffers — the same calls as for one buffer, on the blocking
//! connection and on a batch.

mod common;

use common::{assert_bytes_eq, open, pattern, rights};
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Local};
use mralloc::verbs::{Access, Pd, RegisteredBuf};
use mralloc::Error;

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_gathered_sends_and_writes_scatter_into_parts() {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    // A receive that would wait for a failed sender gives up (the test fails, not hangs).
    let mut opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
    opts.wait.recv_timeout = Some(std::time::Duration::from_secs(20));
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let mut header = heap.alloc(16).unwrap();
    header.copy_from_slice(&pattern(1, 16));
    let mut payload = heap.alloc(64 << 10).unwrap();
    payload.copy_from_slice(&pattern(2, 64 << 10));
    let mut want = header.to_vec();
    want.extend_from_slice(&payload);

    // SEND of header + payload, received into a header buffer and a payload buffer.
    let mut rh = heap.alloc(16).unwrap();
    let mut rp = heap.alloc(64 << 10).unwrap();
    std::thread::scope(|s| {
        let r = s.spawn(|| b.recv(&mut [&mut rh[..], &mut rp[..]]).unwrap());
        a.send(&[&header[..], &payload[..]]).unwrap();
        assert_eq!(r.join().unwrap().len, want.len());
    });
    assert_bytes_eq(&rh, &want[..16], "the scattered header");
    assert_bytes_eq(&rp, &want[16..], "the scattered payload");

    // WRITE of three parts (slices of two buffers) to an offset of the peer's memory.
    let target = heap.alloc_zeroed(128 << 10).unwrap().expose().unwrap();
    a.write(&[&header[..8], &payload[..1000], &header[8..]], &target.remote(), 4096).unwrap();
    let got = target.to_vec();
    let mut expect = header[..8].to_vec();
    expect.extend_from_slice(&payload[..1000]);
    expect.extend_from_slice(&header[8..]);
    assert_bytes_eq(&got[4096..4096 + expect.len()], &expect, "the gathered WRITE");
    assert!(got[..4096].iter().all(|&x| x == 0) && got[4096 + expect.len()..].iter().all(|&x| x == 0));

    // READ scattered into three parts (two buffers), from an offset of the peer's memory; the
    // same gathered WRITE and scattered READ through a batch.
    let mut r1 = heap.alloc(8).unwrap();
    let mut r2 = heap.alloc(2000).unwrap();
    let (r2a, r2b) = r2.split_at_mut(1000);
    a.read(&mut [&mut r1[..], r2a, &mut r2b[..8]], &target.remote(), 4096).unwrap();
    assert_bytes_eq(&r1, &expect[..8], "the READ's first part");
    assert_bytes_eq(&r2[..1008], &expect[8..], "the READ's other parts");
    let (mut s1, mut s2) = (heap.alloc_zeroed(1000).unwrap(), heap.alloc_zeroed(8).unwrap());
    // A batch borrows the lists as long as the memory.
    let gather = [&payload[..1000], &header[..]];
    let mut scatter = [&mut s1[..], &mut s2[..]];
    let mut batch = a.batch();
    batch.write(&gather, &target.remote(), 65536).unwrap();
    batch.read(&mut scatter, &target.remote(), 4096 + 8).unwrap();
    batch.submit().unwrap();
    assert_bytes_eq(&s1, &payload[..1000], "the batch's scattered READ, first part");
    assert_bytes_eq(&s2, &header[8..], "the batch's scattered READ, second part");
    assert_bytes_eq(
        &target.to_vec()[65536..65536 + 1016],
        &[&payload[..1000], &header[..]].concat(),
        "the batch's WRITE",
    );

    // Parts of different kinds (a registered buffer outside the heap and a heap buffer), each
    // under its own key.
    let mut reg = RegisteredBuf::new(&pd, 100, Access::LOCAL_WRITE).unwrap();
    reg.copy_from_slice(&pattern(3, 100));
    let mut all = heap.alloc(100 + 16).unwrap();
    std::thread::scope(|s| {
        let r = s.spawn(|| b.recv(&mut [&mut all[..]]).unwrap());
        a.send(&[&reg as &dyn Local, &header]).unwrap();
        assert_eq!(r.join().unwrap().len, 116);
    });
    assert_bytes_eq(&all[..100], &reg[..], "the registered buffer's part");
    assert_bytes_eq(&all[100..], &header[..], "the heap buffer's part");

    // Refused before anything is posted; the connection stays usable.
    let before = (a.stats().send_requests, b.stats().recv_requests);
    let too_many = a.qp().caps().max_send_sge as usize + 1;
    let many: Vec<&[u8]> = vec![&header[..]; too_many];
    assert!(matches!(a.send(&many), Err(Error::InvalidArgument(_))));
    let mut spare = heap.alloc(64).unwrap();
    let too_many_recv = b.qp().caps().max_recv_sge as usize + 1;
    let mut parts: Vec<&mut [u8]> = spare.chunks_mut(64 / too_many_recv.min(64)).take(too_many_recv).collect();
    assert!(matches!(b.recv(&mut parts), Err(Error::InvalidArgument(_))));
    let mut stack = [0u8; 16];
    assert!(matches!(b.recv(&mut [&mut stack[..]]), Err(Error::NotRegistered { .. })));
    assert!(matches!(a.send(&[&header[..], &header[..0]]), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.send::<[&[u8]]>(&[]), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.recv::<[&mut [u8]]>(&mut []), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        a.read(&mut [&mut spare[..8], &mut stack[..]], &target.remote(), 0),
        Err(Error::NotRegistered { .. })
    ));
    let plain = [7u8; 64]; // on the stack: not registered
    assert!(matches!(a.send(&[&header[..], &plain[..]]), Err(Error::NotRegistered { .. })));
    assert!(matches!(a.write(&[&payload[..], &payload[..]], &target.remote(), 4096), Err(Error::OutOfBounds { .. })));
    assert!(a.error().is_none() && b.error().is_none());
    assert_eq!((a.stats().send_requests, b.stats().recv_requests), before, "refused calls posted nothing");
}
