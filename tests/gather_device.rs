//! Scatter/gather: one SEND or WRITE from a header and a payload in different allocations, one
//! receive or READ into several buffers — the same calls as for one buffer, on the blocking
//! connection and on a batch (borrowed lists), on `Pending` and the async front end (owned
//! lists, given back whole).

mod common;

use std::time::{Duration, Instant};

use common::{assert_bytes_eq, open, pattern, rights};
use mralloc::heap::Heap;
use mralloc::transfer::{Arrival, Connection, IoBuf, Local};
use mralloc::verbs::{Access, Pd, RegisteredBuf};
use mralloc::{Buffer, Error};

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

fn filled(heap: &Heap, want: &[u8]) -> Buffer {
    let mut b = heap.alloc(want.len()).unwrap();
    b.copy_from_slice(want);
    b
}

fn addrs(parts: &[Buffer]) -> Vec<u64> {
    parts.iter().map(Buffer::addr).collect()
}

/// Reaps completions on `conn` until `done()` holds (at most 10 s).
fn until(conn: &Connection, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        conn.progress().unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_owned_lists_gather_and_scatter_through_pending() {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    let mut opts = rights(Access::REMOTE_WRITE | Access::REMOTE_READ);
    opts.wait.recv_timeout = Some(Duration::from_secs(20));
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let want = [pattern(1, 16), pattern(2, 64 << 10)].concat();

    // SEND of a Vec (header, payload); received into a Vec of a 10-byte part and a larger
    // one: the message straddles the parts, filled in order, and the length is the total.
    let inbox = b.post_recv(vec![heap.alloc(10).unwrap(), heap.alloc((64 << 10) + 100).unwrap()]).unwrap();
    let sent = vec![filled(&heap, &want[..16]), filled(&heap, &want[16..])];
    let sent_at = addrs(&sent);
    let (sent, _) = a.post_send(sent).unwrap().wait().unwrap();
    assert_eq!(addrs(&sent), sent_at, "the same buffers back, in order");
    assert_bytes_eq(&[&sent[0][..], &sent[1][..]].concat(), &want, "the sent parts, unchanged");
    let (parts, got) = inbox.wait().unwrap();
    assert_eq!((got.len, got.kind), (want.len(), Arrival::Data), "the total that landed");
    assert_bytes_eq(&parts[0], &want[..10], "the first part of the receive");
    assert_bytes_eq(&parts[1][..want.len() - 10], &want[10..], "the second part of the receive");

    // A scatter receive into uninitialised parts: each learns what landed in it.
    let inbox = b.post_recv([heap.alloc_uninit(8).unwrap(), heap.alloc_uninit(100).unwrap()]).unwrap();
    a.post_send(filled(&heap, &want[..50])).unwrap().wait().unwrap();
    let ([head, rest], got) = inbox.wait().unwrap();
    assert_eq!((got.len, head.init_len(), rest.init_len()), (50, 8, 42), "filled in order, as far as they go");
    assert_bytes_eq(&head.into_init()[..], &want[..8], "the uninitialised first part");
    assert_bytes_eq(&rest.into_init()[..], &want[8..50], "the uninitialised second part");

    // WRITE of an array of slices (a header's first half, a payload's start, the header's
    // second half) to an offset of the peer's memory; then with an immediate.
    let target = heap.alloc_zeroed(128 << 10).unwrap().expose().unwrap();
    let (header, payload) = (filled(&heap, &want[..16]), filled(&heap, &want[16..]));
    let expect = [&want[..8], &want[16..1016], &want[8..16]].concat();
    let header2 = filled(&heap, &want[..16]);
    let list = [header.into_slice(..8).unwrap(), payload.into_slice(..1000).unwrap(), header2.into_slice(8..).unwrap()];
    let (list, _) = a.post_write(list, &target.remote(), 4096).unwrap().wait().unwrap();
    let got = target.to_vec();
    assert_bytes_eq(&got[4096..4096 + expect.len()], &expect, "the gathered WRITE");
    assert!(got[..4096].iter().all(|&x| x == 0) && got[4096 + expect.len()..].iter().all(|&x| x == 0));
    let signal = b.post_recv(heap.alloc(8).unwrap()).unwrap();
    let (list, _) = a.post_write_with_imm(list, &target.remote(), 65536, 0xfeed).unwrap().wait().unwrap();
    let (_, got) = signal.wait().unwrap();
    assert_eq!((got.kind, got.imm), (Arrival::ImmediateOnly, Some(0xfeed)));
    assert_bytes_eq(&target.to_vec()[65536..65536 + expect.len()], &expect, "the gathered WRITE with immediate");
    let [h1, _, _] = list;
    assert_eq!(h1.into_inner().len(), 16, "a slice gives its whole buffer back");

    // READ scattered into a Vec of two buffers and into uninitialised parts.
    let (r, _) = a
        .post_read(vec![heap.alloc(8).unwrap(), heap.alloc(1008).unwrap()], &target.remote(), 4096)
        .unwrap()
        .wait()
        .unwrap();
    assert_bytes_eq(&r[0], &expect[..8], "the READ's first part");
    assert_bytes_eq(&r[1], &expect[8..], "the READ's second part");
    let target_r = target.remote();
    let p = a.post_read([heap.alloc_uninit(1000).unwrap(), heap.alloc_uninit(8).unwrap()], &target_r, 4096 + 8);
    let ([x, y], got) = p.unwrap().wait().unwrap();
    assert_eq!((got.len, x.init_len(), y.init_len()), (1008, 1000, 8), "a READ fills every part");
    assert_bytes_eq(&[&x.into_init()[..], &y.into_init()[..]].concat(), &expect[8..], "the uninitialised READ");

    // Refused before anything is posted, the whole list back; the connection stays usable.
    let before = (a.stats().send_requests, b.stats().recv_requests);
    let too_many = a.qp().caps().max_send_sge as usize + 1;
    let many: Vec<Buffer> = (0..too_many).map(|_| filled(&heap, &want[..16])).collect();
    let many_at = addrs(&many);
    let r = a.post_send(many).unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)), "{:?}", r.error);
    assert_eq!(addrs(&r.buf.unwrap()), many_at, "too many parts: every part back");
    let many: Vec<Buffer> = (0..too_many).map(|_| heap.alloc(16).unwrap()).collect();
    let r = a.post_read(many, &target.remote(), 0).unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)) && r.buf.unwrap().len() == too_many);
    let too_many_recv = b.qp().caps().max_recv_sge as usize + 1;
    let many: Vec<Buffer> = (0..too_many_recv).map(|_| heap.alloc(16).unwrap()).collect();
    let r = b.post_recv(many).unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)) && r.buf.unwrap().len() == too_many_recv);
    let (h, e) = (filled(&heap, &want[..16]), heap.alloc(64).unwrap());
    let (h_at, e_at) = (h.addr(), e.addr());
    let r = a.post_write(vec![h.into_slice(..).unwrap(), e.into_slice(..0).unwrap()], &target.remote(), 0).unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)), "an empty part: {:?}", r.error);
    let back: Vec<Buffer> = r.buf.unwrap().into_iter().map(|s| s.into_inner()).collect();
    assert_eq!(addrs(&back), [h_at, e_at], "an empty part: every part back");
    let r = a.post_send(Vec::<Buffer>::new()).unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)) && r.buf.unwrap().is_empty(), "no parts");
    let empty = heap.alloc(8).unwrap().into_slice(..0).unwrap();
    let r = b.post_recv([heap.alloc(16).unwrap().into_slice(..).unwrap(), empty]).unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)), "an empty receive part: {:?}", r.error);
    let plain = vec![7u8; 64]; // the system allocator's: not registered
    let r = a.post_send(vec![want[..16].to_vec(), plain]).unwrap_err();
    assert!(matches!(r.error, Error::NotRegistered { .. }), "{:?}", r.error);
    assert_eq!(r.buf.unwrap()[1], vec![7u8; 64], "an unregistered part: every part back");
    let r = a.post_write(vec![filled(&heap, &want[16..]), filled(&heap, &want[16..])], &target.remote(), 4096);
    let r = r.unwrap_err();
    assert!(matches!(r.error, Error::OutOfBounds { .. }) && r.buf.unwrap().len() == 2);
    assert!(a.error().is_none() && b.error().is_none());
    assert_eq!((a.stats().send_requests, b.stats().recv_requests), before, "refused posts posted nothing");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_dropped_gathered_write_in_flight_keeps_every_part_alive() {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    let mut opts = rights(Access::REMOTE_WRITE);
    opts.wait.op_timeout = Duration::from_secs(20);
    let (a, b) = Connection::pair(&pd, &opts).unwrap();
    let sizes = [4096, 1 << 20, 4096];
    let n: usize = sizes.iter().sum();
    let dst = heap.alloc_zeroed(n).unwrap().expose().unwrap();
    let before = heap.stats().live_bytes;

    // A gathered WRITE that is certainly still in flight when dropped: it queues behind a SEND
    // the peer has no receive for (RNR retries for ever; one queue executes in order). Every
    // part stays live, and no part's address is handed out again, until the peer posts a
    // receive.
    let blocker = filled(&heap, &[0x11; 4096]);
    let parts: Vec<Buffer> =
        sizes.iter().enumerate().map(|(i, &len)| filled(&heap, &pattern(10 + i as u64, len))).collect();
    let want = parts.iter().map(|p| p.to_vec()).collect::<Vec<_>>().concat();
    let held_at = addrs(&parts);
    let blocker = a.post_send(blocker).unwrap();
    let held = a.post_write(parts, &dst.remote(), 0).unwrap();
    drop((blocker, held));
    std::thread::sleep(Duration::from_millis(200));
    a.progress().unwrap();
    assert_eq!(heap.stats().live_bytes, before + 4096 + n as u64, "every part of the held WRITE is live");
    let again: Vec<Buffer> = sizes.iter().map(|&len| heap.alloc(len).unwrap()).collect();
    assert!(again.iter().all(|x| !held_at.contains(&x.addr())), "a held part's address was handed out again");
    drop(again);
    assert!(dst.to_vec().iter().all(|&x| x == 0), "the write behind the held SEND has not run");
    let (inbox, got) = b.post_recv(heap.alloc(4096).unwrap()).unwrap().wait().unwrap();
    assert_eq!((got.len, inbox[0]), (4096, 0x11));
    drop(inbox);
    until(&a, "the held SEND's buffer and every part are freed", || heap.stats().live_bytes == before);
    assert_bytes_eq(&dst.revoke().unwrap(), &want, "the dropped gathered WRITE completed, every part in order");
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_async_owned_lists_gather_and_scatter() {
    use mralloc::transfer::AsyncConnection;
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build().unwrap();
    let (a, b) = AsyncConnection::pair(&pd, &rights(Access::REMOTE_WRITE | Access::REMOTE_READ)).unwrap();
    let want = [pattern(3, 16), pattern(4, 8192)].concat();

    // A gathered SEND into a scattered receive that straddles the parts.
    let inbox = b.recv(vec![heap.alloc(10).unwrap(), heap.alloc(9000).unwrap()]);
    let sent = a.send(vec![filled(&heap, &want[..16]), filled(&heap, &want[16..])]).await.unwrap();
    assert_eq!(sent.len(), 2);
    let (parts, got) = inbox.await.unwrap();
    assert_eq!(got.len, want.len(), "the total that landed");
    assert_bytes_eq(&parts[0], &want[..10], "the async receive's first part");
    assert_bytes_eq(&parts[1][..want.len() - 10], &want[10..], "the async receive's second part");

    // A gathered WRITE (an array), a WRITE with immediate, and a scattered READ back.
    let target = heap.alloc_zeroed(32 << 10).unwrap().expose().unwrap();
    let list = [filled(&heap, &want[16..]), filled(&heap, &want[..16])];
    let list = a.write(list, &target.remote(), 100).await.unwrap();
    let expect = [&want[16..], &want[..16]].concat();
    assert_bytes_eq(&target.to_vec()[100..100 + expect.len()], &expect, "the async gathered WRITE");
    let signal = b.recv(heap.alloc(8).unwrap());
    a.write_with_imm(list, &target.remote(), 16384, 9).await.unwrap();
    assert_eq!(signal.await.unwrap().1.imm, Some(9));
    assert_bytes_eq(&target.to_vec()[16384..16384 + expect.len()], &expect, "the async gathered WRITE with immediate");
    let r =
        a.read(vec![heap.alloc(8000).unwrap(), heap.alloc_uninit(208).unwrap().into_buffer()], &target.remote(), 100);
    let r = r.await.unwrap();
    assert_bytes_eq(&[&r[0][..], &r[1][..]].concat(), &expect, "the async scattered READ");
    let uninit = a.read([heap.alloc_uninit(16).unwrap(), heap.alloc_uninit(8192).unwrap()], &target.remote(), 100);
    let [x, y] = uninit.await.unwrap();
    assert_eq!((x.init_len(), y.init_len()), (16, 8192));
    assert_bytes_eq(&[&x.into_init()[..], &y.into_init()[..]].concat(), &expect, "the async uninitialised READ");

    // Refusals give the whole list back.
    // 64 parts: over any device's scatter/gather entries (4 are asked for).
    let too_many = (0..64).map(|_| heap.alloc(8).unwrap()).collect::<Vec<_>>();
    let r = a.send(too_many).await.unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)) && r.buf.unwrap().len() == 64, "too many parts");
    let empty = heap.alloc(8).unwrap().into_slice(..0).unwrap();
    let r = b.recv(vec![heap.alloc(8).unwrap().into_slice(..).unwrap(), empty]).await.unwrap_err();
    assert!(matches!(r.error, Error::InvalidArgument(_)) && r.buf.unwrap().len() == 2, "an empty part");
    assert!(a.error().is_none() && b.error().is_none());
}
