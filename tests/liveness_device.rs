//! Idle peers, dead peers and failing ports: an idle connection waits as long as it must, a
//! dead one is found by the connection watcher (the setup TCP stream closing, RDMA CM
//! DISCONNECTED, the device's PORT_ERR) rather than by an operation timing out.

mod common;

use std::time::{Duration, Instant};

use common::{assert_bytes_eq, open, pattern, spawn_self, wait_for, WAIT};
use mralloc::heap::Heap;
use mralloc::transfer::{CmListener, Connection, Listener, Options, WaitOptions};
use mralloc::verbs::{Pd, PortState};
use mralloc::{Disconnect, Error};

/// How long a dead peer may take to surface (documented: the kernel closes a dead process's
/// sockets and CM ids at once; the watcher reacts to that within milliseconds — this is the
/// generous bound of a slow, emulated VM).
const BOUND: Duration = Duration::from_secs(5);

/// Options whose receives give up after 30 s: were the watcher broken, the tests below would
/// fail with a timeout instead of hanging.
fn bounded() -> Options {
    Options {
        wait: WaitOptions { recv_timeout: Some(Duration::from_secs(30)), ..Default::default() },
        ..Options::default()
    }
}

fn setup() -> (Pd, Heap) {
    let pd = Pd::new(&open()).unwrap();
    let heap = Heap::builder().bind(&pd).build().unwrap();
    (pd, heap)
}

/// Seconds the idle test stays silent (`MRALLOC_IDLE_SECS`, default 60).
fn idle_secs() -> u64 {
    std::env::var("MRALLOC_IDLE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60)
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_an_idle_peer_is_not_a_dead_one() {
    let (pd, heap) = setup();
    let listener = Listener::bind("127.0.0.1:0", &pd, Options::default()).unwrap();
    let addr = listener.local_addr().unwrap();
    let idle = Duration::from_secs(idle_secs());
    let server = std::thread::spawn({
        let heap = heap.clone();
        move || {
            let conn = listener.accept().unwrap();
            std::thread::sleep(idle);
            let mut msg = heap.alloc(4096).unwrap();
            msg.copy_from_slice(&pattern(3, 4096));
            conn.send(&msg).unwrap();
            // Traffic the other way after the silence, too.
            let mut back = heap.alloc(4096).unwrap();
            assert_eq!(conn.recv(&mut back).unwrap().len, 4096);
            assert_bytes_eq(&back, &pattern(4, 4096), "the reply after the idle period");
        }
    });
    let conn = Connection::connect(addr, &pd, Options::default()).unwrap();
    let start = Instant::now();
    let mut inbox = heap.alloc(4096).unwrap();
    let got = conn.recv(&mut inbox).expect("a receive outlives an idle peer");
    let waited = start.elapsed();
    assert!(waited >= idle - Duration::from_millis(100), "the receive returned after {waited:?}");
    assert_eq!(got.len, 4096);
    assert_bytes_eq(&inbox, &pattern(3, 4096), "the message after the idle period");
    let mut reply = heap.alloc(4096).unwrap();
    reply.copy_from_slice(&pattern(4, 4096));
    conn.send(&reply).unwrap();
    server.join().unwrap();
    println!("idle peer: the receive waited {waited:?} and the connection kept working");

    // Asked for, a receive limit still applies: it fails the connection with a timeout.
    let (a, _b) = Connection::pair(
        &pd,
        &Options {
            wait: WaitOptions { recv_timeout: Some(Duration::from_millis(300)), ..Default::default() },
            ..Options::default()
        },
    )
    .unwrap();
    let mut r = heap.alloc(64).unwrap();
    assert!(matches!(a.recv(&mut r), Err(Error::Timeout(..))));
    assert!(a.error().is_some());
}

/// The peer role of the kill tests: connects (TCP setup when `MRALLOC_PEER_TCP` names the
/// listener, RDMA CM when `MRALLOC_PEER_CM` does), says so, and waits to be killed.
fn peer_role() -> bool {
    let tcp = std::env::var("MRALLOC_PEER_TCP").ok();
    let cm = std::env::var("MRALLOC_PEER_CM").ok();
    if tcp.is_none() && cm.is_none() {
        return false;
    }
    let (pd, _heap) = setup();
    let _conn = match (tcp, cm) {
        (Some(addr), _) => common::connect_retrying(|| Connection::connect(addr.as_str(), &pd, Options::default())),
        (None, Some(addr)) => {
            let (ip, port) = addr.rsplit_once(':').unwrap();
            common::connect_retrying(|| {
                Connection::connect_cm((ip, port.parse::<u16>().unwrap()), &pd, Options::default())
            })
        }
        _ => unreachable!(),
    };
    println!("peer: connected");
    std::thread::sleep(Duration::from_secs(600));
    panic!("the peer was not killed");
}

/// Kills `child` once the connection is up and a receive waits on it; returns what the
/// receive reported and how long after the kill.
fn kill_during_a_receive(conn: &Connection, heap: &Heap, mut child: std::process::Child) -> (Error, Duration) {
    let pid = child.id() as libc::pid_t;
    let killed = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let k = killed.clone();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        *k.lock().unwrap() = Some(Instant::now());
        // SAFETY: signals our own child process.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    });
    let mut inbox = heap.alloc(4096).unwrap();
    let r = conn.recv(&mut inbox);
    let after = killed.lock().unwrap().expect("the receive returned before the kill").elapsed();
    killer.join().unwrap();
    let _ = child.wait();
    (r.expect_err("a receive from a killed peer"), after)
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_killed_tcp_peer_is_found_by_its_closed_stream() {
    if peer_role() {
        return;
    }
    let (pd, heap) = setup();
    let listener = Listener::bind("127.0.0.1:0", &pd, bounded()).unwrap();
    let addr = listener.local_addr().unwrap();
    let child =
        spawn_self("device_a_killed_tcp_peer_is_found_by_its_closed_stream", ("MRALLOC_PEER_TCP", addr.to_string()));
    let conn = listener.accept().unwrap();
    let (e, after) = kill_during_a_receive(&conn, &heap, child);
    println!("killed TCP peer: {e} after {after:?}");
    assert!(matches!(e, Error::Disconnected(Disconnect::PeerClosed | Disconnect::PeerReset { .. })), "{e:?}");
    assert!(after < BOUND, "found after {after:?}");
    // The connection stays failed with the same reason; posting fails fast.
    let mut more = heap.alloc(64).unwrap();
    assert!(matches!(conn.recv(&mut more), Err(Error::Disconnected(_))));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_killed_cm_peer_is_found_by_its_disconnect() {
    if peer_role() {
        return;
    }
    let ip = std::env::var("MRALLOC_CM_ADDR")
        .expect("MRALLOC_CM_ADDR: an IP address of the RDMA device (scripts/softroce sets it)");
    let (pd, heap) = setup();
    let port = 30000 + (std::process::id() % 20000) as u16;
    let l = CmListener::bind((ip.as_str(), port), &pd, bounded()).unwrap();
    let child =
        spawn_self("device_a_killed_cm_peer_is_found_by_its_disconnect", ("MRALLOC_PEER_CM", format!("{ip}:{port}")));
    let conn = l.accept().unwrap();
    let (e, after) = kill_during_a_receive(&conn, &heap, child);
    println!("killed CM peer: {e} after {after:?}");
    assert!(matches!(e, Error::Disconnected(Disconnect::CmDisconnected)), "{e:?}");
    assert!(after < BOUND, "found after {after:?}");
}

/// The network device under the RDMA device's port 1 (rxe: the netdev it was created on).
fn netdev_of(device: &str) -> String {
    let gid = std::env::var("MRALLOC_GID_INDEX").unwrap_or_else(|_| "0".into());
    let p = format!("/sys/class/infiniband/{device}/ports/1/gid_attrs/ndevs/{gid}");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}")).trim().to_string()
}

fn ip_link(dev: &str, state: &str) -> bool {
    std::process::Command::new("ip").args(["link", "set", "dev", dev, state]).status().is_ok_and(|s| s.success())
}

/// Brings the link back up however the test ends.
struct LinkUp(String);

impl Drop for LinkUp {
    fn drop(&mut self) {
        ip_link(&self.0, "up");
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_port_down_fails_connections_through_the_async_event() {
    if std::env::var("MRALLOC_IN_VM").is_err() {
        // scripts/test counts this marker as skipped, not passed.
        println!("mralloc-test: SKIPPED device_port_down_fails_connections_through_the_async_event: only inside the Soft-RoCE VM (it takes the RDMA netdev down)");
        return;
    }
    let (pd, heap) = setup();
    let ctx = pd.context().clone();
    let dev = netdev_of(ctx.name());
    let (a, b) = Connection::pair(&pd, &bounded()).unwrap();
    // `a` stays alive here: dropping it would tell `b` its peer closed, which may come before
    // the watcher reaches `b` with the port's event.
    let a = std::sync::Arc::new(a);
    let waiter = std::thread::spawn({
        let (heap, a) = (heap.clone(), a.clone());
        move || {
            let mut inbox = heap.alloc(64).unwrap();
            let r = a.recv(&mut inbox);
            (r.map(|g| g.len), Instant::now())
        }
    });
    wait_for("the receive posted", WAIT, || a.stats().recvs_in_flight == 1);
    let down = Instant::now();
    let guard = LinkUp(dev.clone());
    assert!(ip_link(&dev, "down"), "ip link set dev {dev} down");
    let (r, at) = waiter.join().unwrap();
    drop(guard);
    let after = at.saturating_duration_since(down);
    println!("port down ({dev}): {r:?} after {after:?}");
    assert!(matches!(r, Err(Error::Disconnected(Disconnect::PortDown { port: 1 }))), "{r:?}");
    assert!(after < BOUND, "found after {after:?}");
    assert!(matches!(b.error(), Some(Error::Disconnected(Disconnect::PortDown { .. }))), "both ends on the port");
    // The port comes back for the tests that follow.
    let start = Instant::now();
    while !matches!(ctx.port(1).map(|p| p.state), Ok(PortState::Active)) {
        assert!(start.elapsed() < Duration::from_secs(30), "port 1 did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (x, y) = Connection::pair(&pd, &Options::default()).unwrap();
    let mut msg = heap.alloc(64).unwrap();
    msg.copy_from_slice(&pattern(9, 64));
    let mut inbox = heap.alloc(64).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| x.send(&msg).unwrap());
        y.recv(&mut inbox).unwrap();
    });
    assert_bytes_eq(&inbox, &pattern(9, 64), "a new connection after the port came back");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_dropping_one_end_of_a_pair_fails_the_other() {
    let (pd, heap) = setup();
    let (a, b) = Connection::pair(&pd, &bounded()).unwrap();
    let a = std::sync::Arc::new(a);
    let waiter = std::thread::spawn({
        let (heap, a) = (heap.clone(), a.clone());
        move || {
            let mut inbox = heap.alloc(64).unwrap();
            a.recv(&mut inbox).map(|g| g.len)
        }
    });
    wait_for("the receive posted", WAIT, || a.stats().recvs_in_flight == 1);
    let t = Instant::now();
    drop(b);
    let r = waiter.join().unwrap();
    println!("pair end dropped: {r:?} after {:?}", t.elapsed());
    assert!(matches!(r, Err(Error::Disconnected(Disconnect::PeerClosed))), "{r:?}");
}

/// fork(): the child's copies of the parent's device, PD, heap and connections refuse every use
/// with `Error::Forked` and destroy nothing when dropped; the child opens a device of its own and
/// connects; the parent's connection works on after the child's drops (its QP was not destroyed).
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_forked_child_gets_typed_errors_and_leaves_the_parent_working() {
    let ctx = open();
    let pd = Pd::new(&ctx).unwrap();
    let heap = Heap::builder().bind(&pd).build().unwrap();
    let (a, b) = Connection::pair(&pd, &bounded()).unwrap();
    let mut msg = heap.alloc(4096).unwrap();
    msg.copy_from_slice(&pattern(7, 4096));
    // Traffic first, so that the parent's counters are not all zero.
    let mut first = heap.alloc(4096).unwrap();
    std::thread::scope(|s| {
        let r = s.spawn(|| b.recv(&mut first).unwrap().len);
        a.send(&msg).unwrap();
        assert_eq!(r.join().unwrap(), 4096);
    });
    assert!(a.stats() != mralloc::transfer::ConnectionStats::default() && msg.keys_for(&pd).is_some());
    drop(first);
    // SAFETY: the test threads run one at a time (scripts/test); the child runs the checks in
    // its only thread and _exits without unwinding into libtest.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let checks = std::panic::AssertUnwindSafe(|| forked_child(&ctx, &pd, &heap, &a, &b, &msg));
        let code = std::panic::catch_unwind(checks).unwrap_or(99);
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    let start = Instant::now();
    let mut status = 0;
    // SAFETY: pid is our child.
    while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } != pid {
        if start.elapsed() > Duration::from_secs(60) {
            // SAFETY: our child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "child check {} failed (see forked_child)", libc::WEXITSTATUS(status));
    // The parent's pair is intact: a round trip after the child dropped its copies.
    let mut inbox = heap.alloc(4096).unwrap();
    std::thread::scope(|s| {
        let r = s.spawn(|| b.recv(&mut inbox).unwrap().len);
        a.send(&msg).unwrap();
        assert_eq!(r.join().unwrap(), 4096);
    });
    assert_bytes_eq(&inbox, &pattern(7, 4096), "a message after the fork");
    assert!(a.error().is_none() && b.error().is_none());
    println!("fork: the child got typed errors and made its own connection; the parent's pair works on");
}

/// The forked child's checks: 0 when all held, else the number of the one that failed.
fn forked_child(
    ctx: &mralloc::verbs::Context,
    pd: &Pd,
    heap: &Heap,
    a: &Connection,
    b: &Connection,
    msg: &mralloc::Buffer,
) -> i32 {
    let forked = |r: Result<(), Error>| matches!(r, Err(Error::Forked(_)));
    if !forked(a.send(msg).map(drop)) {
        return 1;
    }
    let local = mralloc::verbs::RegisteredBuf::new(pd, 64, mralloc::verbs::Access::LOCAL_WRITE);
    if !forked(local.map(drop)) || !forked(b.progress().map(drop)) || !forked(a.close()) {
        return 2;
    }
    if !forked(heap.alloc(64).map(drop)) || !forked(Pd::new(ctx).map(drop)) {
        return 3;
    }
    // Reads of the parent's state take none of its locks (a parent thread may have held one
    // at the fork): the connection's counters read zero, the parent's registrations give no
    // keys, the heap's counters still answer.
    if a.stats() != mralloc::transfer::ConnectionStats::default() {
        return 6;
    }
    if msg.keys_for(pd).is_some() || heap.keys_for(msg.as_ptr(), pd).is_some() {
        return 7;
    }
    if heap.stats().chunks == 0 {
        return 8;
    }
    // Dropping copies of the parent's objects destroys nothing of the parent's.
    // SAFETY: owned copies, each dropped once here; the originals are never dropped in the
    // child (it _exits).
    unsafe {
        drop(std::ptr::read(a));
        drop(std::ptr::read(b));
        drop(std::ptr::read(msg));
        drop(std::ptr::read(heap));
        drop(std::ptr::read(pd));
        drop(std::ptr::read(ctx));
    }
    // The child's own device, heap and pair work.
    let pd2 = Pd::new(&open()).unwrap();
    let heap2 = Heap::builder().bind(&pd2).build().unwrap();
    let (c, d) = Connection::pair(&pd2, &bounded()).unwrap();
    let mut m = heap2.alloc(512).unwrap();
    m.copy_from_slice(&pattern(9, 512));
    let mut r = heap2.alloc(512).unwrap();
    let got = std::thread::scope(|s| {
        let t = s.spawn(|| d.recv(&mut r).map(|g| g.len));
        c.send(&m).unwrap();
        t.join().unwrap()
    });
    if got.ok() != Some(512) || r[..] != pattern(9, 512)[..] {
        return 4;
    }
    0
}

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim_end().to_string())
        .collect()
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_one_liveness_thread_watches_devices_connections_and_probes() {
    // A bound heap (device removal), a TCP-made connection with keepalive (its stream, its
    // device's events, its probes), a CM connection (its event channel), a pair: all watched by
    // one thread.
    let (pd, heap) = setup();
    let opts = Options { keepalive: Some(Duration::from_millis(200)), ..bounded() };
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let (a, b) = std::thread::scope(|s| {
        let b = s.spawn(|| listener.accept().unwrap());
        (Connection::connect(addr, &pd, opts.clone()).unwrap(), b.join().unwrap())
    });
    let ip = std::env::var("MRALLOC_CM_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let cm_addr = (ip.as_str(), 41000 + (std::process::id() % 10000) as u16);
    let cl = CmListener::bind(cm_addr, &pd, Options::default()).unwrap();
    let (c, d) = std::thread::scope(|s| {
        let d = s.spawn(|| cl.accept().unwrap());
        (Connection::connect_cm(cm_addr, &pd, Options::default()).unwrap(), d.join().unwrap())
    });
    let pair = Connection::pair(&pd, &Options::default()).unwrap();
    // Where each peer is, as setup saw it (TCP: the stream's other end; CM: the peer address).
    assert_eq!(a.peer_addr(), Some(addr));
    let b_sees = b.peer_addr().expect("the client's TCP address");
    assert!(b_sees.ip().is_loopback() && b_sees.port() != addr.port(), "{b_sees}");
    let cm_ip: std::net::IpAddr = ip.parse().unwrap();
    assert_eq!(c.peer_addr().map(|p| (p.ip(), p.port())), Some((cm_ip, cm_addr.1)));
    assert_eq!(d.peer_addr().map(|p| p.ip()), Some(cm_ip));
    assert_eq!(pair.0.peer_addr(), None);
    // Probes went out and came back (several intervals), and the connections work.
    std::thread::sleep(Duration::from_secs(1));
    let mut msg = heap.alloc(64).unwrap();
    msg.copy_from_slice(&pattern(9, 64));
    let mut inbox = heap.alloc(64).unwrap();
    std::thread::scope(|s| {
        let r = s.spawn(|| b.recv(&mut inbox).unwrap());
        a.send(&msg).unwrap();
        assert_eq!(r.join().unwrap().len, 64);
    });
    assert!(a.error().is_none() && b.error().is_none() && c.error().is_none() && d.error().is_none());
    let names = thread_names();
    // The kernel keeps 15 bytes of a thread's name.
    let liveness = names.iter().filter(|n| *n == &"mralloc-liveness"[..15]).count();
    assert_eq!(liveness, 1, "one liveness thread, got {names:?}");
    assert!(
        !names.iter().any(|n| n == "mralloc-watch" || n == "mralloc-devices"),
        "no separate watcher or device monitor thread: {names:?}"
    );
    drop((a, b, c, d, pair, listener, cl));
}

/// The listeners add no thread: the blocking `Listener`'s handshakes run inside the calls made
/// on it, the `AsyncListener`'s (and `AsyncConnection::connect`'s exchange) as tasks on the
/// runtime, their queue pairs' connect step on the runtime's own blocking pool. With both
/// serving clients and each holding a silent client's handshake, no `mralloc-accept` or
/// `mralloc-handshake` thread exists, and the only thread mralloc added is the liveness thread
/// (besides the runtime's blocking-pool threads, which the runtime owns and reuses).
#[cfg(feature = "tokio")]
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_listeners_and_their_handshakes_add_no_thread() {
    use mralloc::transfer::{AsyncConnection, AsyncListener};
    let tasks = || -> Vec<(String, String)> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let t = t.ok()?;
                let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
                Some((t.file_name().to_string_lossy().into_owned(), name.trim_end().to_string()))
            })
            .collect()
    };
    let before: Vec<String> = tasks().into_iter().map(|(id, _)| id).collect();
    let (pd, _heap) = setup();
    let opts = bounded();
    // Blocking: three clients, accepted one after another, and a silent one in flight.
    let listener = Listener::bind("127.0.0.1:0", &pd, opts.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let blocking: Vec<(Connection, Connection)> = std::thread::scope(|s| {
        let server = s.spawn(|| (0..3).map(|_| listener.accept().unwrap()).collect::<Vec<_>>());
        let clients: Vec<_> = (0..3).map(|_| Connection::connect(addr, &pd, opts.clone()).unwrap()).collect();
        clients.into_iter().zip(server.join().unwrap()).collect()
    });
    let _silent = std::net::TcpStream::connect(addr).unwrap();
    wait_for("the silent client in flight", WAIT, || listener.handshakes_in_flight() == 1);
    // Async, on a runtime of no thread of its own: three clients, and a silent one in flight.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().thread_name("rt-pool").build().unwrap();
    let (alistener, asynced, _asilent) = rt.block_on(async {
        let l = AsyncListener::bind("127.0.0.1:0", &pd, opts.clone()).await.unwrap();
        let a = l.local_addr().unwrap();
        let mut conns = Vec::new();
        for _ in 0..3 {
            let (c, s) = tokio::join!(AsyncConnection::connect(a, &pd, opts.clone()), l.accept());
            conns.push((c.unwrap(), s.unwrap()));
        }
        let silent = tokio::net::TcpStream::connect(a).await.unwrap();
        let start = Instant::now();
        while l.handshakes_in_flight() != 1 {
            assert!(start.elapsed() < WAIT, "the async silent client never got in flight");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (l, conns, silent)
    });
    let now = tasks();
    println!("threads with both listeners serving: {now:?}");
    let named = |n: &str| now.iter().any(|(_, name)| n.starts_with(name.as_str()));
    assert!(!named("mralloc-accept") && !named("mralloc-handshake"), "a listener thread: {now:?}");
    let added: Vec<&String> =
        now.iter().filter(|(id, name)| !before.contains(id) && name != "rt-pool").map(|(_, name)| name).collect();
    // The kernel keeps 15 bytes of a thread's name.
    assert!(added.iter().all(|n| *n == &"mralloc-liveness"[..15]), "threads mralloc added: {added:?}");
    assert!(added.len() <= 1, "threads mralloc added: {added:?}");
    drop((blocking, listener));
    rt.block_on(async move { drop((asynced, alistener)) });
}
