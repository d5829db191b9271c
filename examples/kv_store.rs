//! `kv_store`: a storage node keeps fixed-size values in its registered heap and publishes their
//! `RemoteBuf`; clients GET with one-sided RDMA READs (the server's CPU is not involved) and PUT
//! with an RDMA WRITE followed by a SEND notification the server applies (it bumps the key's
//! version). Several client processes run at once; at the end the server checks every value and
//! version against the deterministic plan.
//!
//! ```text
//! scripts/softroce -- cargo run --release --example kv_store -- [--clients 3] [--ops 200]
//! kv_store server --port 7491 --clients 3 ; kv_store client --addr S:7491 --id 0 --clients 3 --ops 200
//! ```

mod common;

use std::time::Instant;

use common::{fail, Args, Opt, Spec};
use mralloc::transfer::{Connection, Listener, Options, QpOptions};
use mralloc::verbs::Access;
use mralloc::RemoteBuf;

const KEYS_PER_CLIENT: usize = 16;
const VALUE: usize = 4096;

static SPEC: Spec = Spec {
    name: "kv_store",
    about: "A storage node's values in its registered heap: clients GET by one-sided RDMA READ and PUT by\n\
            RDMA WRITE + a SEND notification; the server verifies the final state against the plan.",
    no_role: "the server and --clients client processes in this command (child processes)",
    roles: &[("server", "serve --clients clients, then verify"), ("client", "run --ops operations against --addr")],
    opts: &[
        Opt::num("clients", "N", "client processes (default 3); the same on every process of a run"),
        Opt::num("ops", "N", "operations per client, PUTs and GETs alternating (default 200)"),
        Opt::port("port", "the port to listen on (default 7491)").roles(&["server"]),
        Opt::text("addr", "HOST:PORT", "the server (default 127.0.0.1:7491)").roles(&["client"]),
        Opt::num("id", "N", "this client's number, 0 to clients-1 (default 0)").roles(&["client"]),
    ],
};

/// The value client `c` writes to `key` in its operation `i`.
fn value(c: usize, key: usize, i: usize) -> Vec<u8> {
    common::data(((c as u64) << 40) ^ ((key as u64) << 20) ^ i as u64, VALUE)
}

/// The plan: client `c`'s operation `i` PUTs key `c + clients * (i % KEYS_PER_CLIENT)` when `i` is
/// even, and GETs a key of another client when it is odd.
fn put_key(c: usize, clients: usize, i: usize) -> usize {
    c + clients * (i % KEYS_PER_CLIENT)
}

fn main() {
    let args = Args::parse(&SPEC);
    let r = match args.role.as_deref() {
        Some("server") => server(&args),
        Some("client") => client(&args),
        None => all(&args),
        Some(other) => fail(&format!("unknown role {other} (server | client)")),
    };
    if let Err(e) = r {
        fail(&format!("kv_store: {e}"));
    }
}

fn all(args: &Args) -> mralloc::Result<()> {
    let (clients, ops) = (args.num("clients", 3), args.num("ops", 200));
    let port = common::free_port();
    let common =
        |v: &mut Vec<String>| v.extend(["--clients".into(), clients.to_string(), "--ops".into(), ops.to_string()]);
    let mut sargs = vec!["--port".into(), port.to_string()];
    common(&mut sargs);
    let mut children = vec![("server".to_string(), common::spawn_role("server", &sargs))];
    for c in 0..clients {
        let mut cargs = vec!["--addr".into(), format!("127.0.0.1:{port}"), "--id".into(), c.to_string()];
        common(&mut cargs);
        children.push((format!("client {c}"), common::spawn_role("client", &cargs)));
    }
    let server = children.remove(0);
    common::wait_all(children);
    common::wait_all(vec![server]);
    println!("kv_store: OK");
    Ok(())
}

fn server(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(None, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    let (clients, ops) = (args.num("clients", 3), args.num("ops", 200));
    let keys = clients * KEYS_PER_CLIENT;
    // Clients PUT by RDMA WRITE into the table: it goes to the network (exposed, with its own
    // write and read key) until every client is done.
    let table = heap.alloc_zeroed(keys * VALUE)?.expose()?;
    let offer = table.remote().to_bytes();
    // The server's threads mostly wait for notifications: they sleep on the completion channel
    // after a short spin (the default wait). Clients GET by READ and PUT by WRITE into this
    // heap: the server's QPs allow both.
    let opts = Options {
        qp: QpOptions { remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ, ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind(("0.0.0.0", args.num("port", 7491) as u16), &pd, opts)?;
    println!("serving {keys} keys x {VALUE} bytes ({} bytes of registered heap) to {clients} clients", keys * VALUE);
    let conns: Vec<Connection> = (0..clients).map(|_| listener.accept_with(&offer)).collect::<mralloc::Result<_>>()?;
    // Apply PUT notifications (key, client) from every client until each says it is done.
    let mut versions = vec![0u32; keys];
    let puts = std::sync::Mutex::new(&mut versions);
    std::thread::scope(|s| -> mralloc::Result<()> {
        let hs: Vec<_> = conns
            .iter()
            .map(|conn| {
                let (heap, puts) = (&heap, &puts);
                s.spawn(move || -> mralloc::Result<usize> {
                    let mut n = 0;
                    // Keep a receive posted at all times, so a client's notification never waits
                    // for the server to come back around (no RNR back-off).
                    let mut next = conn.post_recv(heap.alloc(8)?)?;
                    loop {
                        let (msg, _) = next.wait()?;
                        let key = u32::from_be_bytes(msg[..4].try_into().expect("4 bytes"));
                        if key == u32::MAX {
                            return Ok(n);
                        }
                        next = conn.post_recv(msg)?;
                        let mut v = puts.lock().expect("versions lock");
                        let slot = v
                            .get_mut(key as usize)
                            .ok_or_else(|| mralloc::Error::Protocol(format!("PUT of unknown key {key}")))?;
                        *slot += 1;
                        n += 1;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().expect("notification thread")?;
        }
        Ok(())
    })?;
    // Every client has sent its last notification after its last PUT completed: revoke the
    // clients' key and take the table back to verify the final state against the plan.
    let table = table.revoke()?;
    let mut expect_versions = vec![0u32; keys];
    let mut last = vec![None; keys];
    for c in 0..clients {
        for i in (0..ops).step_by(2) {
            let k = put_key(c, clients, i);
            expect_versions[k] += 1;
            last[k] = Some((c, i));
        }
    }
    let mut bad = 0;
    for k in 0..keys {
        let got = &table[k * VALUE..(k + 1) * VALUE];
        let want = last[k].map(|(c, i)| value(c, k, i)).unwrap_or_else(|| vec![0; VALUE]);
        if got != &want[..] || versions[k] != expect_versions[k] {
            bad += 1;
        }
    }
    let total: u32 = versions.iter().sum();
    println!("applied {total} PUT notifications; {} of {keys} keys hold the planned value and version", keys - bad);
    if bad > 0 {
        fail("final state differs from the plan");
    }
    Ok(())
}

fn client(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(None, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    let (id, clients, ops) = (args.num("id", 0), args.num("clients", 3), args.num("ops", 200));
    let addr = args.str_or("addr", "127.0.0.1:7491");
    let conn = common::retry(|| Connection::connect(addr.as_str(), &pd, Options::default()))?;
    let table = RemoteBuf::from_bytes(conn.peer_blob())?;
    let mut val = heap.alloc(VALUE)?;
    let mut got = heap.alloc(VALUE)?;
    let mut note = heap.alloc(8)?;
    let (mut put_t, mut get_t) = (common::latencies(), common::latencies());
    for i in 0..ops {
        if i % 2 == 0 {
            let k = put_key(id, clients, i);
            val.copy_from_slice(&value(id, k, i));
            let t = Instant::now();
            conn.write(&val, &table, (k * VALUE) as u64)?; // PUT: one-sided write...
            note[..4].copy_from_slice(&(k as u32).to_be_bytes());
            note[4..].copy_from_slice(&(i as u32).to_be_bytes());
            conn.send(&note)?; // ...then the notification the server applies
            common::record(&mut put_t, t.elapsed());
            // Read-your-write: only this client writes this key.
            conn.read(&mut got, &table, (k * VALUE) as u64)?;
            if got[..] != val[..] {
                fail(&format!("client {id}: GET of key {k} right after PUT returned other bytes"));
            }
        } else {
            // GET another client's key (it may be mid-update: the bytes are not checked).
            let k = ((id + 1) % clients) + clients * (i % KEYS_PER_CLIENT);
            let t = Instant::now();
            conn.read(&mut got, &table, (k * VALUE) as u64)?;
            common::record(&mut get_t, t.elapsed());
        }
    }
    note[..4].copy_from_slice(&u32::MAX.to_be_bytes());
    conn.send(&note)?;
    let (puts, gets) = (ops.div_ceil(2), ops / 2);
    println!(
        "client {id}: {puts} PUTs (write + notify: {}), {gets} GETs by one-sided READ ({}), read-your-writes verified",
        common::percentiles(&put_t),
        common::percentiles(&get_t)
    );
    Ok(())
}
