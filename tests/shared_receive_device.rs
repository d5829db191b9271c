//! A server with many connections over one shared receive queue: fixed receive memory, every
//! message tagged with the connection it came over.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{assert_bytes_eq, open, pattern};
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, Options, QpOptions, SetupOptions, SharedReceiver, WaitOptions};
use mralloc::verbs::Pd;
use mralloc::Error;

const CLIENTS: usize = 256;
const MESSAGES: usize = 4;
const SLOTS: u32 = 64;
const SLOT: usize = 2048;

fn message(client: usize, n: usize) -> Vec<u8> {
    let mut m = (client as u32).to_le_bytes().to_vec();
    m.extend_from_slice(&(n as u32).to_le_bytes());
    m.extend_from_slice(&pattern((client * MESSAGES + n) as u64, 1000 + client));
    m
}

fn raise_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer; raising the soft limit to the hard one.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}

/// 256 clients connect to one server whose connections all take receives from one SRQ of 64
/// buffers; each client sends 4 messages (1024 in all, through 64 buffers) and gets a reply
/// naming what the server saw; the server tells every message's connection apart.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_256_connections_share_one_receive_queue() {
    raise_fd_limit();
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).build().unwrap();
    let shared = SharedReceiver::new(&pd, SLOTS, SLOT).unwrap();
    let server_opts = Options {
        qp: QpOptions { send_depth: 8, ..Default::default() },
        setup: SetupOptions { connect_timeout: Duration::from_secs(60), ..Default::default() },
        shared_receive: Some(shared.clone()),
        ..Options::default()
    };
    let client_opts = Options {
        qp: QpOptions { send_depth: 8, recv_depth: 8, ..Default::default() },
        wait: WaitOptions { recv_timeout: Some(Duration::from_secs(120)), ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind("127.0.0.1:0", &pd, server_opts).unwrap();
    let addr = listener.local_addr().unwrap();
    let started = Instant::now();
    std::thread::scope(|s| {
        let clients: Vec<_> = (0..8)
            .map(|t| {
                let (pd, heap, opts) = (&pd, &heap, client_opts.clone());
                s.spawn(move || {
                    let conns: Vec<(usize, Connection)> = (t * CLIENTS / 8..(t + 1) * CLIENTS / 8)
                        .map(|i| (i, common::connect_retrying(|| Connection::connect(addr, pd, opts.clone()))))
                        .collect();
                    for n in 0..MESSAGES {
                        for (i, c) in &conns {
                            let m = message(*i, n);
                            let mut b = heap.alloc(m.len()).unwrap();
                            b.copy_from_slice(&m);
                            c.send(&b).unwrap();
                        }
                    }
                    for (i, c) in &conns {
                        let mut r = heap.alloc(8).unwrap();
                        let got = c.recv(&mut r).unwrap();
                        assert_eq!(got.len, 8);
                        let (who, count) = (
                            u32::from_le_bytes(r[..4].try_into().unwrap()),
                            u32::from_le_bytes(r[4..].try_into().unwrap()),
                        );
                        assert_eq!(who as usize, *i, "the server attributed client {i}'s messages to {who}");
                        assert_eq!(count as usize, MESSAGES);
                    }
                    conns.len()
                })
            })
            .collect();

        let server: Vec<Connection> = (0..CLIENTS).map(|_| listener.accept().unwrap()).collect();
        let connected = started.elapsed();
        for c in &server {
            assert_eq!(c.qp().caps().max_recv_wr, 0, "no receive queue of its own");
            assert!(matches!(c.recv(&mut heap.alloc(8).unwrap()), Err(Error::InvalidArgument(_))));
        }
        let by_qpn: HashMap<u32, usize> = server.iter().enumerate().map(|(k, c)| (c.qp().qpn(), k)).collect();
        // client id and messages seen, per server connection
        let mut seen: Vec<Option<(usize, usize)>> = vec![None; CLIENTS];
        for _ in 0..CLIENTS * MESSAGES {
            let m = shared.recv_timeout(Duration::from_secs(120)).expect("every message arrives");
            assert!(shared.posted() < SLOTS, "a message holds its buffer");
            let k = by_qpn[&m.qp_num()];
            assert!(m.is_from(&server[k]) && !m.is_from(&server[(k + 1) % CLIENTS]));
            let client = u32::from_le_bytes(m[..4].try_into().unwrap()) as usize;
            let n = u32::from_le_bytes(m[4..8].try_into().unwrap()) as usize;
            assert_bytes_eq(&m, &message(client, n), "a message through the shared queue");
            let e = seen[k].get_or_insert((client, 0));
            assert_eq!(e.0, client, "one connection, one client");
            assert_eq!(e.1, n, "messages of one connection arrive in order");
            e.1 += 1;
        }
        for (k, c) in server.iter().enumerate() {
            let (client, count) = seen[k].expect("every connection delivered");
            let mut reply = heap.alloc(8).unwrap();
            reply[..4].copy_from_slice(&(client as u32).to_le_bytes());
            reply[4..].copy_from_slice(&(count as u32).to_le_bytes());
            c.send(&reply).unwrap();
        }
        let total: usize = clients.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(total, CLIENTS);
        let mut clients_seen: Vec<usize> = seen.iter().map(|s| s.unwrap().0).collect();
        clients_seen.sort_unstable();
        assert_eq!(clients_seen, (0..CLIENTS).collect::<Vec<_>>(), "every client, once");
        assert_eq!(shared.posted(), SLOTS, "every buffer is back in the queue");
        assert_eq!(shared.failed_receives(), 0);
        assert!(shared.try_recv().unwrap().is_none());
        println!(
            "shared receive: {CLIENTS} connections in {:.1} s, {} messages through {SLOTS} buffers; receive memory {} KiB \
             for all of them (without the shared queue: {} KiB at recv_depth 256 x {SLOT} B each)",
            connected.as_secs_f64(),
            CLIENTS * MESSAGES,
            shared.memory_bytes() >> 10,
            (CLIENTS * 256 * SLOT) >> 10
        );
        drop(server);
    });
    assert_eq!(shared.memory_bytes(), SLOTS as usize * SLOT, "independent of the connection count");
}

/// Misuse is refused: async connections do not take a shared queue, a queue of another PD is
/// refused at setup, and a receiver outlives its connections (and they it).
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_shared_receive_misuse_is_refused() {
    let ctx = open();
    let pd = Pd::new(&ctx).unwrap();
    let other = Pd::new(&ctx).unwrap();
    let foreign = SharedReceiver::new(&other, 4, 64).unwrap();
    let opts = Options { shared_receive: Some(foreign), ..Options::default() };
    assert!(matches!(Connection::pair(&pd, &opts), Err(Error::InvalidArgument(_))));
    assert!(matches!(SharedReceiver::new(&pd, 0, 64), Err(Error::InvalidArgument(_))));
    // A pair whose both ends use the queue; the receiver dropped before the connections.
    let shared = SharedReceiver::new(&pd, 4, 64).unwrap();
    let (a, b) =
        Connection::pair(&pd, &Options { shared_receive: Some(shared.clone()), ..Options::default() }).unwrap();
    let heap = Heap::builder().bind(&pd).build().unwrap();
    let mut m = heap.alloc(64).unwrap();
    m.copy_from_slice(&pattern(3, 64));
    a.send(&m).unwrap();
    let got = shared.recv_timeout(Duration::from_secs(20)).unwrap();
    assert!(got.is_from(&b) && !got.is_from(&a));
    assert_bytes_eq(&got, &pattern(3, 64), "over a pair");
    drop(shared);
    drop(got);
    drop((a, b));
    // Oversized: the sender's connection fails, the receiver's buffer goes back.
    let shared = SharedReceiver::new(&pd, 2, 64).unwrap();
    let (a, _b) =
        Connection::pair(&pd, &Options { shared_receive: Some(shared.clone()), ..Options::default() }).unwrap();
    let big = heap.alloc(65).unwrap();
    assert!(a.send(&big).is_err(), "a message longer than a slot fails");
    let deadline = Instant::now() + Duration::from_secs(20);
    while shared.failed_receives() == 0 && Instant::now() < deadline {
        assert!(shared.try_recv().unwrap().is_none());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(shared.failed_receives(), 1);
    assert_eq!(shared.posted(), 2);
}
