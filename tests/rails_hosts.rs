//! A rail group between two hosts linked twice (`scripts/softroce --hosts 2 --links dual`: two
//! links, an rxe device on each end of each): set up in one call, striped writes and reads
//! verified byte for byte, a list of 1000 pages to scattered offsets, and one link cut in the
//! middle of a 64 MiB transfer — which completes on the other rail, names the dead one, and
//! leaks nothing — then brought back up, and a new connection over it restored as rail 1. Run by scripts/test; outside such a boot (no MRALLOC_LINKS) it fails.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, Options, QpOptions, RailOptions, Rails, RailsListener, WaitOptions};
use mralloc::verbs::{Access, Context, Pd};
use mralloc::{Buffer, RemoteDesc};

const BIG: usize = 64 << 20;
const PAGE: usize = 4096;
const RESTORED: usize = 9 << 20;

fn word(heap: &Heap, w: &[u8]) -> Buffer {
    let mut b = heap.alloc(w.len()).unwrap();
    b.copy_from_slice(w);
    b
}

/// Waits for the peer's word `w` on the message rail.
fn expect(rails: &Rails, heap: &Heap, w: &[u8]) {
    let mut b = heap.alloc(16).unwrap();
    let got = rails.recv(&mut b).unwrap();
    assert_eq!(&b[..got.len], w, "the peer's word");
}

#[test]
#[ignore = "needs linked RDMA hosts: run scripts/test"]
fn device_dual_rails_stripe_and_survive_a_cut_link() {
    let me: usize = std::env::var("MRALLOC_HOST").expect("MRALLOC_HOST").parse().unwrap();
    let links = links();
    assert_eq!(links.len(), 2, "host {me}: run under --links dual");
    let pds: Vec<Pd> = links.iter().map(|l| Pd::new(&Context::open(&l.device).unwrap()).unwrap()).collect();
    let heap = Heap::builder().access(Access::ALL_REMOTE).bind(&pds[0]).bind(&pds[1]).build().unwrap();
    // Default retries and no keepalive: host 0 learns of the cut from its own port going down.
    // (Under TCG a busy peer answers late: a retry count of 6, or keepalive probes every
    // 500 ms, failed the busy rail 0 too in an earlier run.)
    let opts = RailOptions {
        conn: Options {
            qp: QpOptions { remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ, ..Default::default() },
            wait: WaitOptions { op_timeout: Duration::from_secs(60), ..Default::default() },
            ..Options::default()
        },
        slice: 256 << 10,
        window: 4 << 20,
        ..RailOptions::default()
    };
    // Host 1 owns the target; host 0 moves the bytes.
    let inbox = heap.alloc(BIG).unwrap().expose().unwrap();
    inbox.write_from(0, &vec![0; BIG]).unwrap();
    let desc = inbox.desc().unwrap().to_vec();
    // The baseline: QPs, MRs beyond the heap's chunks' own (two per chunk, one per device), and
    // the bytes allocated.
    let pdns = our_pdns();
    let others = |heap: &Heap| resources("mr", &pdns) as i64 - 2 * heap.stats().chunks as i64;
    let (qps0, mrs0, live0) = (resources("qp", &pdns), others(&heap), heap.stats().live_bytes);
    let mut rails = if me == 0 {
        let l = RailsListener::bind((links[0].local_ip.as_str(), 7910), &pds, opts.clone()).unwrap();
        l.accept().unwrap()
    } else {
        connect_retrying(|| Rails::connect_with((links[0].peer_ip.as_str(), 7910), &pds, opts.clone(), &desc))
    };
    let info = rails.info();
    println!("host {me}: {info:?}");
    assert_eq!(info.len(), 2);
    for (r, l) in info.iter().zip(&links) {
        assert!(r.alive && r.device == l.device && r.gbps.is_some_and(|g| g > 0.0), "{r:?}");
    }

    if me == 1 {
        expect(&rails, &heap, b"striped");
        assert_bytes_eq(&inbox.to_vec(), &pattern(BIG as u64, BIG), "host 1: the 64 MiB striped write");
        rails.send(&word(&heap, b"ok")).unwrap();
        expect(&rails, &heap, b"pages");
        let got = inbox.to_vec();
        for i in 0..1000 {
            let at = ((i * 7919) % 16000) * PAGE;
            assert_bytes_eq(&got[at..at + PAGE], &pattern(5000 + i as u64, PAGE), &format!("host 1: page {i}"));
        }
        rails.send(&word(&heap, b"ok")).unwrap();
        expect(&rails, &heap, b"cut");
        assert_bytes_eq(&inbox.to_vec(), &pattern(777, BIG), "host 1: the 64 MiB write that lost a link midway");
        rails.send(&word(&heap, b"ok")).unwrap();
        // Link 1 comes back: a new connection over it takes rail 1's place on both sides.
        let conn =
            connect_retrying(|| Connection::connect((links[1].peer_ip.as_str(), 7911), &pds[1], opts.conn.clone()));
        rails.restore(1, conn).unwrap();
        expect(&rails, &heap, b"restored");
        assert_bytes_eq(&inbox.to_vec()[..RESTORED], &pattern(778, RESTORED), "host 1: written over both rails again");
        rails.send(&word(&heap, b"ok")).unwrap();
    } else {
        let theirs = RemoteDesc::from_bytes(rails.peer_blob()).unwrap();
        assert_eq!(theirs.keys().len(), 2, "a key per device of the peer");
        // Striped writes and reads, 1 B to 64 MiB.
        for n in [1usize, 4097, (1 << 20) + 1, 9 << 20, BIG] {
            let t = Instant::now();
            let mut src = heap.alloc(n).unwrap();
            src.copy_from_slice(&pattern(n as u64, n));
            let done = rails.post_write(src, &theirs, 0).map_err(|r| r.error).unwrap().wait();
            let took = t.elapsed();
            assert!(done.is_ok(), "{n}: {done:?}");
            let moved: Vec<u64> = done.rails().iter().map(|r| r.bytes).collect();
            assert_eq!(moved.iter().sum::<u64>(), n as u64);
            if n > 2 * opts.slice {
                assert!(moved.iter().all(|&b| b > 0), "{n} bytes over both rails: {moved:?}");
            }
            let back = rails.post_read(heap.alloc_uninit(n).unwrap(), &theirs, 0).map_err(|r| r.error).unwrap().wait();
            let (mut bufs, _) = back.into_result().unwrap();
            assert_bytes_eq(&bufs.pop().unwrap().into_init(), &pattern(n as u64, n), &format!("host 0: {n} read back"));
            println!("host 0: {n} bytes striped in {took:?}, per rail {moved:?}; read back, verified");
        }
        rails.send(&word(&heap, b"striped")).unwrap();
        expect(&rails, &heap, b"ok");
        // 1000 pages to scattered offsets, one transfer; read back as one.
        let at = |i: usize| (((i * 7919) % 16000) * PAGE) as u64;
        let pages: Vec<(Buffer, RemoteDesc)> = (0..1000)
            .map(|i| (word(&heap, &pattern(5000 + i as u64, PAGE)), theirs.slice(at(i)..at(i) + PAGE as u64).unwrap()))
            .collect();
        let done = rails.post_write_list(pages).wait();
        println!("host 0: 1000 pages: {:?}", done.rails());
        assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0), "{done:?}");
        let reads: Vec<(Buffer, RemoteDesc)> =
            (0..1000).map(|i| (heap.alloc(PAGE).unwrap(), theirs.slice(at(i)..at(i) + PAGE as u64).unwrap())).collect();
        let (back, _) = rails.post_read_list(reads).wait().into_result().unwrap();
        for (i, p) in back.iter().enumerate() {
            assert_bytes_eq(p, &pattern(5000 + i as u64, PAGE), &format!("host 0: page {i} read back"));
        }
        rails.send(&word(&heap, b"pages")).unwrap();
        expect(&rails, &heap, b"ok");

        // 64 MiB, and link 1 cut under it once rail 1 carried some.
        let mut src = heap.alloc(BIG).unwrap();
        src.copy_from_slice(&pattern(777, BIG));
        let before = rails.info()[1].bytes;
        let mut t = rails.post_write(src, &theirs, 0).map_err(|r| r.error).unwrap();
        wait_for("rail 1 to carry part of the transfer", Duration::from_secs(60), || {
            t.progress();
            rails.info()[1].bytes > before
        });
        // Down at once (an ioctl, not a spawned `ip`): rail 1's window, just refilled, is
        // still on the wire.
        let dev = netdev_of(&links[1].device);
        let in_flight = rails.info()[1].outstanding;
        let cut = Instant::now();
        set_link(&dev, false);
        let done = t.wait();
        println!(
            "host 0: {dev} cut with {in_flight} bytes in flight on rail 1; done after {:?}: {:?}",
            cut.elapsed(),
            done.rails()
        );
        assert!(done.is_ok(), "{done:?}");
        let r1 = &done.rails()[1];
        assert!(
            matches!(r1.failure, Some(mralloc::Error::Disconnected(mralloc::Disconnect::PortDown { .. }))),
            "the report names rail 1's failure: {r1:?}"
        );
        assert!(in_flight == 0 || r1.reposted > 0, "rail 1's slices in flight were posted again: {r1:?}");
        assert_eq!(done.rails().iter().map(|r| r.bytes).sum::<u64>(), BIG as u64);
        let info = rails.info();
        assert!(info[0].alive && !info[1].alive && info.iter().all(|r| r.outstanding == 0), "{info:?}");
        drop(done);
        rails.send(&word(&heap, b"cut")).unwrap();
        expect(&rails, &heap, b"ok");
        set_link(&dev, true);
        let t = Instant::now();
        let conn =
            Listener::bind((links[1].local_ip.as_str(), 7911), &pds[1], opts.conn.clone()).unwrap().accept().unwrap();
        rails.restore(1, conn).unwrap();
        let mut src = heap.alloc(RESTORED).unwrap();
        src.copy_from_slice(&pattern(778, RESTORED));
        let done = rails.post_write(src, &theirs, 0).map_err(|r| r.error).unwrap().wait();
        println!("host 0: rail 1 restored {:?} after the link came up: {:?}", t.elapsed(), done.rails());
        assert!(done.is_ok() && done.rails().iter().all(|r| r.bytes > 0 && r.failure.is_none()), "{done:?}");
        drop(done);
        rails.send(&word(&heap, b"restored")).unwrap();
        expect(&rails, &heap, b"ok");
    }
    // Nothing leaks: the group's QPs and the transfers' registrations are gone with it.
    drop(rails);
    wait_for("the rails' QPs to go", Duration::from_secs(10), || resources("qp", &pdns) == qps0);
    assert_eq!(others(&heap), mrs0, "host {me}: memory regions other than the chunks' back to the baseline");
    assert_eq!(heap.stats().live_bytes, live0, "host {me}: every buffer of the transfers freed");
    println!("host {me}: QPs, MRs and live bytes back to the baseline ({qps0}, {mrs0}, {live0})");
    drop(inbox);
}

/// Sets network device `dev` up or down (`SIOCSIFFLAGS`, as `ip link set` does).
fn set_link(dev: &str, up: bool) {
    // SAFETY: a plain datagram socket, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: an all-zero ifreq is valid; the name fits (checked) with its NUL.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    assert!(dev.len() < req.ifr_name.len(), "{dev}: name too long");
    for (d, s) in req.ifr_name.iter_mut().zip(dev.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: `req` names the device; the kernel fills in its flags.
    let got = unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) };
    assert_eq!(got, 0, "SIOCGIFFLAGS {dev}: {}", std::io::Error::last_os_error());
    // SAFETY: the flags member of the union, just read by SIOCGIFFLAGS.
    unsafe {
        let flags = &mut req.ifr_ifru.ifru_flags;
        *flags = if up { *flags | libc::IFF_UP as libc::c_short } else { *flags & !(libc::IFF_UP as libc::c_short) };
    }
    // SAFETY: as above; the kernel reads the flags.
    let set = unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) };
    let err = std::io::Error::last_os_error();
    // SAFETY: `fd` is ours, closed once.
    unsafe { libc::close(fd) };
    assert_eq!(set, 0, "SIOCSIFFLAGS {dev} up={up}: {err}");
}
