//! Device removal (`rdma link delete`) with a live heap, connections (TCP and RDMA CM),
//! blocked accepts and receives: every waiter gets a typed error within bounds, nothing new is
//! made on the removed device, the heap lets go of the device by itself (it stays alive
//! throughout), the kernel's removal completes once the application drops its connections —
//! and after the device is added back, the same heap binds to it and its old buffers carry data.
//! Twice: first without RDMA CM (only the device monitor can notice), then with it.
//!
//! scripts/test runs this binary last: it deletes the device (and adds it back).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{device_name, open, pattern, wait_for, WAIT};
use mralloc::heap::Heap;
use mralloc::transfer::{CmListener, Connection, Listener, Options, SharedReceiver};
use mralloc::verbs::{Context, Pd, PortState};
use mralloc::{Disconnect, Error};

fn rdma(args: &[&str]) -> std::process::Child {
    std::process::Command::new("rdma").args(args).spawn().unwrap_or_else(|e| panic!("rdma {args:?}: {e}"))
}

fn run(cmd: &str, args: &[&str]) {
    let st = std::process::Command::new(cmd).args(args).status().unwrap_or_else(|e| panic!("{cmd} {args:?}: {e}"));
    assert!(st.success(), "{cmd} {args:?}: {st}");
}

/// A second Soft-RoCE device (on a veth pair of its own) that stays while the first one is
/// deleted.
/// librdmacm lets go of a removed device's context only if some device is left (its device
/// list sync gives up on an empty list), so without it rxe's removal would wait for this
/// process to exit; see `Context::is_removed`.
struct OtherDevice;

const OTHER: &str = "mrx1";

impl OtherDevice {
    fn add() -> OtherDevice {
        let _ = std::process::Command::new("ip").args(["link", "del", "mrveth0"]).status();
        run("ip", &["link", "add", "mrveth0", "type", "veth", "peer", "name", "mrveth1"]);
        run("ip", &["link", "set", "mrveth0", "up"]);
        run("ip", &["link", "set", "mrveth1", "up"]);
        run("rdma", &["link", "add", OTHER, "type", "rxe", "netdev", "mrveth0"]);
        OtherDevice
    }
}

impl OtherDevice {
    /// Deletes it; `false` if the kernel's removal did not complete within 20 s.
    fn delete(&self) -> bool {
        let done = wait_child(&mut rdma(&["link", "delete", OTHER]), Duration::from_secs(20)).is_some();
        let _ = std::process::Command::new("ip").args(["link", "del", "mrveth0"]).status();
        done
    }
}

impl Drop for OtherDevice {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(format!("/sys/class/infiniband/{OTHER}")).is_ok() {
            self.delete();
        }
    }
}

/// The netdev the device sits on (rxe), read before it goes away.
fn netdev_of(device: &str) -> String {
    let gid = std::env::var("MRALLOC_GID_INDEX").unwrap_or_else(|_| "0".into());
    let p = format!("/sys/class/infiniband/{device}/ports/1/gid_attrs/ndevs/{gid}");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}")).trim().to_string()
}

/// Joins `h`, failing the test if it is not done within `limit` of `since` (a hang).
fn join_within<T>(h: std::thread::JoinHandle<T>, since: Instant, limit: Duration, what: &str) -> (T, Duration) {
    while !h.is_finished() {
        assert!(since.elapsed() < limit, "{what}: still blocked {limit:?} after the removal");
        std::thread::sleep(Duration::from_millis(10));
    }
    (h.join().unwrap(), since.elapsed())
}

/// Waits for `child` to exit within `limit`; `None` if it is still running then.
fn wait_child(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if t.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// This process's descriptors on RDMA devices (for a failure message).
fn device_files() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok().map(|l| (e.file_name(), l)))
        .filter(|(_, l)| l.to_string_lossy().contains("infiniband") || l.to_string_lossy().contains("rdma"))
        .map(|(n, l)| format!("{}->{}", n.to_string_lossy(), l.display()))
        .collect()
}

fn removed_device(e: &Error) -> bool {
    matches!(e, Error::Disconnected(Disconnect::DeviceRemoved) | Error::DeviceRemoved { .. })
}

/// How long a waiter may take to notice (the monitor reacts to the kernel's event at once and
/// checks every 5 s besides; blocked accepts and shared receives look once a second): a bound
/// generous enough for the emulated VM, tight enough to catch a missed event.
const NOTICE: Duration = Duration::from_secs(4);

/// Opens `dev` once it is back and its port is active.
fn reopen(dev: &str) -> Context {
    let t = Instant::now();
    loop {
        if let Ok(ctx) = Context::open(dev) {
            if matches!(ctx.port(1).map(|p| p.state), Ok(PortState::Active)) {
                return ctx;
            }
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{dev} did not come back");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Deletes `dev`, runs `check` (the waiters' outcomes), drops `live` (everything on the device
/// but the heap), waits for the kernel's removal to complete and adds the device back.
fn remove_and_readd<T>(dev: &str, netdev: &str, live: T, check: impl FnOnce(Instant, &T)) -> Context {
    let removed = Instant::now();
    let mut delete = rdma(&["link", "delete", dev]);
    check(removed, &live);
    let pending = wait_child(&mut delete, Duration::from_millis(200));
    println!("`rdma link delete` before the drops: {}", if pending.is_some() { "done" } else { "still waiting" });
    let dropped = Instant::now();
    drop(live);
    let Some(st) = wait_child(&mut delete, Duration::from_secs(20)) else {
        panic!(
            "`rdma link delete` still waiting 20 s after everything but the heap was dropped; open: {:?}",
            device_files()
        );
    };
    assert!(st.success(), "rdma link delete: {st}");
    println!("removal complete {:?} after the drops ({:?} after it began)", dropped.elapsed(), removed.elapsed());
    let st = rdma(&["link", "add", dev, "type", "rxe", "netdev", netdev]).wait().unwrap();
    assert!(st.success(), "rdma link add {dev}: {st}");
    reopen(dev)
}

/// The heap let go of the removed device (slot 0) by itself and kept the other (slot 1).
fn heap_unbound_from_removed(heap: &Heap, other_pd: &Pd, keep: &[mralloc::heap::Buffer], removed: Instant) {
    let t = Instant::now();
    while heap.stats().registered_bytes[0] != 0 {
        assert!(t.elapsed() < NOTICE, "the heap still holds {} registered bytes", heap.stats().registered_bytes[0]);
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("heap: registrations with the removed device dropped {:?} after the removal", removed.elapsed());
    assert!(heap.stats().registered_bytes[1] > 0, "the binding with {OTHER} went too");
    assert!(keep.iter().all(|b| b.lkey().is_none() && b.keys_for(other_pd).is_some()));
    assert!(keep.iter().enumerate().all(|(i, b)| b[..].iter().all(|&x| x == i as u8)), "the heap's memory changed");
}

/// Binds `heap` to the re-added device and carries a buffer from before the removal. Returns
/// the new PD.
fn rebind_and_carry(heap: &Heap, ctx: &Context, keep: &mut [mralloc::heap::Buffer], seed: u64) -> Pd {
    let pd = Pd::new(ctx).unwrap();
    heap.bind(&pd).unwrap();
    assert!(keep.iter().all(|b| b.lkey().is_some()));
    let (x, y) = Connection::pair(&pd, &Options::default()).unwrap();
    let len = keep[5].len();
    let sent = pattern(seed, len);
    keep[5].copy_from_slice(&sent);
    let mut inbox = heap.alloc(len).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| x.send(&keep[5]).unwrap());
        y.recv(&mut inbox).unwrap();
    });
    assert!(inbox[..] == sent[..], "a buffer from before the removal carried the wrong bytes");
    keep[5].fill(5);
    pd
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_removal_fails_waiters_unbinds_the_heap_and_the_device_comes_back() {
    if std::env::var("MRALLOC_IN_VM").is_err() {
        // scripts/test counts this marker as skipped, not passed: outside the VM the device
        // is somebody's NIC, not ours to delete.
        println!(
            "mralloc-test: SKIPPED device_removal_fails_waiters_unbinds_the_heap_and_the_device_comes_back: \
             only inside the Soft-RoCE VM (it deletes the RDMA device)"
        );
        return;
    }
    let dev = device_name();
    let netdev = netdev_of(&dev);
    let other = OtherDevice::add();
    let ctx = open();
    let pd = Pd::new(&ctx).unwrap();
    let other_ctx = Context::open(OTHER).unwrap();
    let other_pd = Pd::new(&other_ctx).unwrap();
    // Bound to both devices: only the removed one's binding goes.
    let heap = Heap::builder().bind(&pd).bind(&other_pd).build().unwrap();
    let mut keep: Vec<_> = (0..64).map(|i| heap.alloc(4096 << (i % 6)).unwrap()).collect();
    for (i, b) in keep.iter_mut().enumerate() {
        b.fill(i as u8);
    }
    let registered = heap.stats().registered_bytes[0];
    assert!(registered > 0 && keep[0].lkey().is_some());
    assert_eq!(heap.stats().registered_bytes[1], registered);

    // Phase 1, no RDMA CM anywhere: only the device monitor can tell. A TCP-made connection
    // with a receive a thread waits on, a receive blocked on a shared receive queue.
    let listener = Listener::bind("127.0.0.1:0", &pd, Options::default()).unwrap();
    let addr = listener.local_addr().unwrap();
    let (a, b) = std::thread::scope(|s| {
        let b = s.spawn(|| listener.accept().unwrap());
        (Connection::connect(addr, &pd, Options::default()).unwrap(), b.join().unwrap())
    });
    let a = Arc::new(a);
    let recv_on = |conn: &Arc<Connection>| {
        let (conn, heap) = (conn.clone(), heap.clone());
        std::thread::spawn(move || {
            let mut inbox = heap.alloc(4096).unwrap();
            conn.recv(&mut inbox).map(|g| g.len)
        })
    };
    let tcp_waiter = recv_on(&a);
    let shared = SharedReceiver::new(&pd, 8, 1024).unwrap();
    let calling = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let shared_waiter = {
        let (shared, calling) = (shared.clone(), calling.clone());
        std::thread::spawn(move || {
            calling.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            shared.recv().map(|m| m.len())
        })
    };
    wait_for("the receive posted", WAIT, || a.stats().recvs_in_flight == 1);
    wait_for("the shared receive called", WAIT, || calling.load(std::sync::atomic::Ordering::SeqCst) == 1);
    // From the call to its wait (no condition to see): a margin, checked below by the shared
    // receive's still being blocked at the removal.
    std::thread::sleep(Duration::from_millis(50));
    assert!(!shared_waiter.is_finished() && !tcp_waiter.is_finished(), "nothing ended the waits before the removal");
    // rxe finishes the removal only once this process closed the device: the application drops
    // its connections, listener, receive queue, PD and context — and keeps the heap.
    let live = (a, b, listener, shared, pd, ctx);
    let ctx = remove_and_readd(&dev, &netdev, live, |removed, (_, b, _, _, pd, ctx)| {
        let (r, t) = join_within(tcp_waiter, removed, NOTICE, "the receive on the TCP-made connection");
        println!("TCP-made connection's waiting receive: {r:?} after {t:?}");
        assert!(r.as_ref().is_err_and(removed_device), "{r:?}");
        let (r, t) = join_within(shared_waiter, removed, NOTICE, "a blocked SharedReceiver::recv");
        println!("blocked shared receive: {r:?} after {t:?}");
        assert!(r.as_ref().is_err_and(removed_device), "{r:?}");
        // The device is marked (the other one not); nothing new is made on it; operations
        // fail typed.
        assert!(ctx.is_removed() && pd.context().is_removed());
        assert!(!other_ctx.is_removed(), "{OTHER} was declared removed with {dev}");
        for e in [
            Pd::new(ctx).unwrap_err(),
            Heap::new(pd).unwrap_err(),
            Listener::bind("127.0.0.1:0", pd, Options::default()).unwrap_err(),
            SharedReceiver::new(pd, 1, 64).unwrap_err(),
        ] {
            assert!(matches!(e, Error::DeviceRemoved { .. }), "{e:?}");
        }
        let e = b.send(&keep[0]).unwrap_err();
        println!("a send after the removal: {e}");
        assert!(removed_device(&e), "{e:?}");
        heap_unbound_from_removed(&heap, &other_pd, &keep, removed);
        let mut fresh = heap.alloc(1 << 20).unwrap();
        fresh.fill(0x5a);
        assert!(fresh.lkey().is_none() && fresh.keys_for(&other_pd).is_some());
    });
    let pd = rebind_and_carry(&heap, &ctx, &mut keep, 7);
    println!("{dev} back: the heap re-bound and its old buffers carry data");

    // Phase 2, with RDMA CM: a CM connection with a waiting receive, two accepts blocked on a
    // CM listener.
    let ip = std::env::var("MRALLOC_CM_ADDR").expect("MRALLOC_CM_ADDR (set by scripts/softroce)");
    let cm_addr = (ip.as_str(), 40000 + (std::process::id() % 10000) as u16);
    let cl = Arc::new(CmListener::bind(cm_addr, &pd, Options::default()).unwrap());
    let (c, d) = std::thread::scope(|s| {
        let d = s.spawn(|| cl.accept().unwrap());
        (Connection::connect_cm(cm_addr, &pd, Options::default()).unwrap(), d.join().unwrap())
    });
    let c = Arc::new(c);
    let cm_waiter = recv_on(&c);
    let calling = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let accepts: Vec<_> = (0..2)
        .map(|_| {
            let (cl, calling) = (cl.clone(), calling.clone());
            std::thread::spawn(move || {
                calling.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                cl.accept().map(|_| ())
            })
        })
        .collect();
    // A context opened before the removal that nothing watches until after it.
    let late = Context::open(&dev).unwrap();
    wait_for("the receive posted", WAIT, || c.stats().recvs_in_flight == 1);
    wait_for("both accepts called", WAIT, || calling.load(std::sync::atomic::Ordering::SeqCst) == 2);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!cm_waiter.is_finished() && accepts.iter().all(|h| !h.is_finished()), "nothing ended the waits early");
    let ctx = remove_and_readd(&dev, &netdev, (c, d, cl, pd, ctx, late), |removed, (_, d, _, _, _, late)| {
        let (r, t) = join_within(cm_waiter, removed, NOTICE, "the receive on the CM connection");
        println!("CM connection's waiting receive: {r:?} after {t:?}");
        assert!(r.as_ref().is_err_and(removed_device), "{r:?}");
        for h in accepts {
            let (r, t) = join_within(h, removed, NOTICE, "a blocked CmListener::accept");
            println!("blocked accept: {r:?} after {t:?}");
            assert!(r.as_ref().is_err_and(removed_device), "{r:?}");
        }
        let e = d.send(&keep[0]).unwrap_err();
        assert!(removed_device(&e), "{e:?}");
        heap_unbound_from_removed(&heap, &other_pd, &keep, removed);
        // First watched now (a heap bound to it): found removed all the same, and the heap
        // lets go of it.
        assert!(!late.is_removed());
        let late_pd = Pd::new(late).unwrap();
        let late_heap = Heap::new(&late_pd).unwrap();
        let watched = Instant::now();
        while !late.is_removed() || late_heap.stats().registered_bytes[0] != 0 {
            assert!(watched.elapsed() < NOTICE, "a context first watched after the removal was not found removed");
            std::thread::sleep(Duration::from_millis(10));
        }
        println!("a context first watched after the removal: found removed in {:?}", watched.elapsed());
    });
    let pd = rebind_and_carry(&heap, &ctx, &mut keep, 8);
    println!("{dev} back again: the heap re-bound once more");
    drop(keep);
    drop(heap);
    println!("leaked mappings after the heap's drop: {}", mralloc::verbs::leaked_mappings());
    drop((pd, other_pd, other_ctx, ctx));
    // A device this process no longer uses but librdmacm opened (it opens every device when
    // asked to re-read its list): its removal completes too.
    assert!(other.delete(), "deleting {OTHER}: still waiting after 20 s; open: {:?}", device_files());
}
