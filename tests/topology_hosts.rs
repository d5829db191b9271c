//! Exchanges across several hosts (Soft-RoCE VMs linked by `scripts/softroce --hosts N --links
//! T`): every host exchanges data with each neighbour over its own link (its own rxe device),
//! both directions, verified end to end. Run by scripts/test for star, ring and full mesh; each
//! host's run is one test. Also: keepalive probes finding a peer whose path went silent (two
//! hosts). Outside such a boot (no MRALLOC_LINKS) the tests fail: they are excluded from the
//! single-VM device run.

mod common;

use std::time::Duration;

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, DeviceChoice, Listener, Options, QpOptions, WaitOptions};
use mralloc::verbs::{Access, Context, Pd};
use mralloc::RemoteBuf;

const SIZE: usize = 2 << 20;

#[test]
#[ignore = "needs linked RDMA hosts: run scripts/test"]
fn device_topology_exchange() {
    let me: usize = std::env::var("MRALLOC_HOST").expect("MRALLOC_HOST").parse().unwrap();
    let topology = std::env::var("MRALLOC_TOPOLOGY").unwrap_or_default();
    let links = links();
    assert!(!links.is_empty(), "host {me} has no links");
    // One PD per local device; one heap registered with all of them.
    let pds: Vec<Pd> = links.iter().map(|l| Pd::new(&Context::open(&l.device).unwrap()).unwrap()).collect();
    let mut builder = Heap::builder().access(Access::ALL_REMOTE);
    for pd in &pds {
        builder = builder.bind(pd);
    }
    let heap = builder.build().unwrap();
    std::thread::scope(|s| {
        for (l, pd) in links.iter().zip(&pds) {
            let (heap, topology) = (&heap, &topology);
            s.spawn(move || {
                let port = 7600 + 10 * me.min(l.peer) as u16 + me.max(l.peer) as u16;
                let opts = Options {
                    // Each side's inbox is the target of the peer's write-with-immediate.
                    qp: QpOptions { remote_access: Access::REMOTE_WRITE, ..Default::default() },
                    device: DeviceChoice { name: Some(l.device.clone()), ..Default::default() },
                    wait: WaitOptions { op_timeout: Duration::from_secs(60), ..Default::default() },
                    ..Options::default()
                };
                let inbox = heap.alloc(SIZE).unwrap().expose().unwrap();
                let offer = inbox.remote_for(pd).unwrap().to_bytes();
                let conn = if me < l.peer {
                    Listener::bind((l.local_ip.as_str(), port), pd, opts).unwrap().accept_with(&offer).unwrap()
                } else {
                    connect_retrying(|| Connection::connect_with((l.peer_ip.as_str(), port), pd, opts.clone(), &offer))
                };
                let remote = RemoteBuf::from_bytes(conn.peer_blob()).unwrap();
                let mut data = heap.alloc(SIZE).unwrap();
                data.copy_from_slice(&pattern((me * 100 + l.peer) as u64, SIZE));
                // Both directions at once: post our write while the peer posts its own.
                let imm = std::thread::scope(|s2| {
                    let r = s2.spawn(|| conn.recv_imm().unwrap());
                    conn.write_with_imm(&data, &remote, 0, me as u32).unwrap();
                    r.join().unwrap()
                });
                assert_eq!(imm as usize, l.peer, "the immediate names the peer");
                assert_bytes_eq(
                    &inbox.to_vec(),
                    &pattern((l.peer * 100 + me) as u64, SIZE),
                    &format!("host {me} from host {}", l.peer),
                );
                // Hold the connection until the peer has verified too.
                let mut ack = heap.alloc(1).unwrap();
                let p = conn.post_recv(heap.alloc(1).unwrap()).unwrap();
                ack[0] = 1;
                conn.send(&ack).unwrap();
                p.wait().unwrap();
                println!(
                    "host {me} ({topology}): {SIZE} bytes to and from host {} over {} ({} <-> {}) verified",
                    l.peer, l.device, l.local_ip, l.peer_ip
                );
            });
        }
    });
}

/// A peer whose path goes silent (host 1 takes its NIC down: nothing reaches host 0, no FIN, no
/// RDMA CM message, no event on host 0's port) is found by keepalive probes alone: host 0's
/// receives fail with `KeepaliveFailed` within the documented bound — through the transport's
/// `RETRY_EXC_ERR` with a retry count of 6 (its retry time, 0.47 s, well inside the probe's
/// deadline of two 1 s intervals), through the probe's own deadline with the default 7 (which
/// rxe retries for ever) — while a connection to the same peer without keepalive stays unaware.
/// Run by scripts/test over two linked VMs.
#[test]
#[ignore = "needs linked RDMA hosts: run scripts/test"]
fn device_keepalive_finds_a_black_holed_peer() {
    use mralloc::transfer::ConnectionStats;
    use mralloc::verbs::WcStatus;
    use mralloc::{Disconnect, Error};
    use std::time::Instant;

    let me: usize = std::env::var("MRALLOC_HOST").expect("MRALLOC_HOST").parse().unwrap();
    let l = links().into_iter().next().expect("a link");
    let pd = Pd::new(&Context::open(&l.device).unwrap()).unwrap();
    let heap = Heap::builder().bind(&pd).build().unwrap();
    let every = Duration::from_millis(500);
    // Receives bounded: were the probes broken, host 0 would fail with a timeout, not hang.
    let probed = Options {
        device: DeviceChoice { name: Some(l.device.clone()), ..Default::default() },
        wait: WaitOptions { recv_timeout: Some(Duration::from_secs(30)), ..Default::default() },
        keepalive: Some(every),
        ..Options::default()
    };
    let every6 = Duration::from_secs(1);
    let probed6 =
        Options { qp: QpOptions { retry_count: 6, ..probed.qp.clone() }, keepalive: Some(every6), ..probed.clone() };
    let plain =
        Options { device: DeviceChoice { name: Some(l.device.clone()), ..Default::default() }, ..Options::default() };
    // Documented: keepalive + max(2 x keepalive, retry time) + min(keepalive / 4, 250 ms); the
    // retry time is (retry_count + 1) x 4.096 us x 2^14.
    let retry = |n: u64| Duration::from_micros((n + 1) * 4096 * 16384 / 1000);
    let bound6 = every6 + retry(6).max(2 * every6) + every6 / 4;
    let bound7 = every + retry(7).max(2 * every) + every / 4;
    let all = [(7700, &probed6), (7701, &probed), (7702, &plain)];
    let conns: Vec<Connection> = all
        .iter()
        .map(|&(port, opts)| {
            if me == 0 {
                Listener::bind((l.local_ip.as_str(), port), &pd, opts.clone()).unwrap().accept().unwrap()
            } else {
                connect_retrying(|| Connection::connect((l.peer_ip.as_str(), port), &pd, opts.clone()))
            }
        })
        .collect();
    let [k6, k7, q] = &conns[..] else { unreachable!() };
    // Idle for a while first: probes answered by a live peer fail nothing.
    std::thread::sleep(Duration::from_secs(3));
    assert!(conns.iter().all(|c| c.error().is_none()), "host {me}: a live, idle peer was taken for dead");
    let mut word = heap.alloc(64).unwrap();
    if me == 1 {
        word.copy_from_slice(&pattern(77, 64));
        k6.send(&word).unwrap();
        let dev = netdev_of(&l.device);
        let ok = std::process::Command::new("ip").args(["link", "set", "dev", &dev, "down"]).status();
        assert!(ok.is_ok_and(|s| s.success()), "ip link set dev {dev} down");
        println!("host 1: {dev} down; host 0 hears nothing from here on");
        // Stay a while (our own connections see the port go down); host 0 must not need us.
        std::thread::sleep(Duration::from_secs(5));
        return;
    }
    assert_eq!(k6.recv(&mut word).unwrap().len, 64);
    assert_bytes_eq(&word, &pattern(77, 64), "the last word before the cut");
    let cut = Instant::now();
    let wait = |c: &Connection| {
        let mut inbox = heap.alloc(64).unwrap();
        let r = c.recv(&mut inbox).map(|g| g.len);
        (r, cut.elapsed())
    };
    let wait = &wait;
    let (r6, r7) = std::thread::scope(|s| {
        let t7 = s.spawn(move || wait(k7));
        (wait(k6), t7.join().unwrap())
    });
    println!(
        "host 0: black-holed peer found by keepalive: retry_count 6: {:?} after {:?} (documented bound {bound6:?}); \
         retry_count 7: {:?} after {:?} (documented bound {bound7:?}); without keepalive: {:?}",
        r6.0,
        r6.1,
        r7.0,
        r7.1,
        q.error()
    );
    let failed = |r: &mralloc::Result<usize>, want: WcStatus| matches!(r, Err(Error::Disconnected(Disconnect::KeepaliveFailed { status })) if *status == want);
    assert!(failed(&r6.0, WcStatus::RetryExcErr), "{:?}", r6.0);
    // rxe retries for ever with 7: the probe's deadline finds it (a device that counts finds it
    // by RETRY_EXC_ERR first).
    assert!(failed(&r7.0, WcStatus::RespTimeoutErr) || failed(&r7.0, WcStatus::RetryExcErr), "{:?}", r7.0);
    assert!(r6.1 < bound6 + Duration::from_secs(3), "found after {:?}", r6.1);
    assert!(r7.1 < bound7 + Duration::from_secs(3), "found after {:?}", r7.1);
    assert!(q.error().is_none(), "the connection without keepalive cannot know yet");
    let s: ConnectionStats = k6.stats();
    assert_eq!(s.send_requests, 0, "probes are not counted as requests");
}

/// One descriptor, two rails (`scripts/softroce --hosts 2 --links dual`: two links between the
/// two hosts, an rxe device on each end of each). Each host binds one heap to both its devices,
/// exposes one buffer and hands the peer its [`RemoteDesc`] (a key per device, each beside the
/// device's GID) over a connection per link. Each host then WRITEs one half of the peer's buffer
/// through each link, picking per connection the key of the peer's device at its far end
/// (`Connection::remote_of`), and READs it back through the same link: byte for byte. Then host
/// 0 uses, over link 0, the key the peer's link-1 device issued: the peer's device refuses it
/// (`REM_ACCESS_ERR`) and the bytes stay; host 1 revokes its buffer (every per-device
/// registration) and host 0's write with the right key for link 1 is refused too. Prints what a
/// second device costs an exposure (registration plus GID query).
#[test]
#[ignore = "needs linked RDMA hosts: run scripts/test"]
fn device_dual_links_reach_one_buffer_through_either_device() {
    use mralloc::verbs::WcStatus;
    use mralloc::{Error, RemoteDesc};
    use std::time::Instant;

    const HALF: usize = 1 << 20;
    let me: usize = std::env::var("MRALLOC_HOST").expect("MRALLOC_HOST").parse().unwrap();
    let links = links();
    assert_eq!(links.len(), 2, "host {me}: run under --links dual (two links to one peer)");
    let peer = links[0].peer;
    assert_eq!(links[1].peer, peer, "both links lead to the same peer");
    // What a rail group chooses by: both devices listed, each with an active Ethernet port and
    // a rate.
    let listed = mralloc::verbs::devices().unwrap();
    for l in &links {
        let d = listed.iter().find(|d| d.name == l.device).unwrap_or_else(|| panic!("{} listed", l.device));
        let ports = d.ports().unwrap();
        let p = ports.first().expect("a port");
        println!(
            "host {me}: {} port {}: {:?} {:?} {:?} Gb/s, NUMA node {:?}",
            d.name,
            p.port,
            p.state,
            p.link_layer,
            p.gbps(),
            d.numa_node
        );
        assert_eq!((p.state, p.link_layer), (mralloc::verbs::PortState::Active, mralloc::verbs::LinkLayer::Ethernet));
        assert!(p.gbps().is_some_and(|g| g > 0.0), "{} reports a rate: {p:?}", d.name);
    }
    let pds: Vec<Pd> = links.iter().map(|l| Pd::new(&Context::open(&l.device).unwrap()).unwrap()).collect();
    let heap = Heap::builder().access(Access::ALL_REMOTE).bind(&pds[0]).bind(&pds[1]).build().unwrap();

    // What the second device costs an exposure: `expose` registers on the primary device, `desc`
    // adds the second (and queries both GIDs); a second `desc` only queries.
    let (mut one, mut two, mut again) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..15 {
        let b = heap.alloc(HALF).unwrap();
        let t = Instant::now();
        let x = b.expose().unwrap();
        one.push(t.elapsed());
        let t = Instant::now();
        x.desc().unwrap();
        two.push(t.elapsed());
        let t = Instant::now();
        x.desc().unwrap();
        again.push(t.elapsed());
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    println!(
        "host {me}: exposing {HALF} bytes: expose (1 device) {:?}, desc (+1 device, 2 GID queries) {:?}, desc again (GID queries only) {:?} (medians of 15)",
        median(&mut one),
        median(&mut two),
        median(&mut again)
    );

    // A registration on the second device only, so its keys are not the first's by coincidence.
    let _skew = heap.alloc(4096).unwrap().remote_for(&pds[1]).unwrap();
    let inbox = heap.alloc(2 * HALF).unwrap().expose().unwrap();
    inbox.write_from(0, &vec![0; 2 * HALF]).unwrap();
    let desc = inbox.desc().unwrap();
    assert_eq!(desc.keys().len(), 2);
    let blob = desc.to_vec();
    let conns: Vec<Connection> = links
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let opts = Options {
                qp: QpOptions { remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ, ..Default::default() },
                device: DeviceChoice { name: Some(l.device.clone()), ..Default::default() },
                wait: WaitOptions { op_timeout: Duration::from_secs(60), ..Default::default() },
                ..Options::default()
            };
            let port = 7800 + i as u16;
            if me < peer {
                Listener::bind((l.local_ip.as_str(), port), &pds[i], opts).unwrap().accept_with(&blob).unwrap()
            } else {
                connect_retrying(|| Connection::connect_with((l.peer_ip.as_str(), port), &pds[i], opts.clone(), &blob))
            }
        })
        .collect();
    let theirs = RemoteDesc::from_bytes(conns[0].peer_blob()).unwrap();
    assert_eq!(RemoteDesc::from_bytes(conns[1].peer_blob()).unwrap(), theirs);
    let remotes: Vec<RemoteBuf> = conns.iter().map(|c| c.remote_of(&theirs).unwrap()).collect();
    assert_ne!(remotes[0].rkey, remotes[1].rkey, "each link reaches the peer's buffer with its own device's key");
    let sync = |c: &Connection| {
        let p = c.post_recv(heap.alloc(1).unwrap()).unwrap();
        c.send(&heap.alloc(1).unwrap()).unwrap();
        p.wait().unwrap();
    };
    let seed = |from: usize, link: usize| (from * 10 + link) as u64;

    // Each half of the peer's buffer through its own link, then read back through the same.
    for (i, c) in conns.iter().enumerate() {
        let mut data = heap.alloc(HALF).unwrap();
        data.copy_from_slice(&pattern(seed(me, i), HALF));
        c.write(&data, &remotes[i], (i * HALF) as u64).unwrap();
    }
    conns.iter().for_each(sync);
    let got = inbox.to_vec();
    for i in 0..2 {
        let what = format!("host {me}: half {i}, written by host {peer} over {}", links[i].device);
        assert_bytes_eq(&got[i * HALF..(i + 1) * HALF], &pattern(seed(peer, i), HALF), &what);
        let mut back = heap.alloc(HALF).unwrap();
        conns[i].read(&mut back, &remotes[i], (i * HALF) as u64).unwrap();
        assert_bytes_eq(
            &back,
            &pattern(seed(me, i), HALF),
            &format!("host {me}: half {i} read back over {}", links[i].device),
        );
        println!(
            "host {me}: {HALF} bytes written and read back over {} ({} <-> {}), verified",
            links[i].device, links[i].local_ip, links[i].peer_ip
        );
    }
    conns.iter().for_each(sync); // both done reading before anything below breaks a connection

    let refused = |r: mralloc::Result<()>| matches!(r, Err(Error::Operation { status: WcStatus::RemAccessErr, .. }));
    let one_byte = {
        let mut b = heap.alloc(1).unwrap();
        b[0] = 0xEE;
        b
    };
    if me == 0 {
        // The key of the peer's link-1 device, used toward its link-0 device.
        let wrong = RemoteBuf { rkey: remotes[1].rkey, ..remotes[0] };
        let r = conns[0].write(&one_byte, &wrong, 0);
        println!("host 0: the peer's link-1 key over link 0: {r:?}");
        assert!(refused(r), "a key of the peer's other device must be refused");
        sync(&conns[1]);
        // Host 1 revokes, then says so: its key for link 1 (the heap's second PD) is dead.
        let p = conns[1].post_recv(heap.alloc(1).unwrap()).unwrap();
        p.wait().unwrap();
        let r = conns[1].write(&one_byte, &remotes[1], 0);
        println!("host 0: the peer's link-1 key after its revocation: {r:?}");
        assert!(refused(r), "a revoked exposure's key on the second device must be refused");
    } else {
        sync(&conns[1]); // host 0 has tried the wrong key
        assert_eq!(inbox.to_vec()[0], pattern(seed(0, 0), 1)[0], "the refused write left the bytes");
        let buf = inbox.revoke().unwrap();
        assert!(!buf.is_exposed());
        conns[1].send(&heap.alloc(1).unwrap()).unwrap();
        // Stay until host 0 is done: its refused write breaks the connection (or it leaves).
        let p = conns[1].post_recv(heap.alloc(1).unwrap()).unwrap();
        let _ = p.wait();
        drop(buf);
    }
}
