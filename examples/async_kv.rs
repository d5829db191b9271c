//! `async_kv`: a key-value store on tokio (feature `tokio`). The server keeps a table of
//! fixed-size slots in its registered heap and hands each client the table's `RemoteBuf` when it
//! connects.
//!
//! - **GET** is one RDMA READ of the key's slot: the server's CPU is not involved. A slot holds
//!   `[version u64][checksum u64][value]`; a read that races with an update sees a checksum
//!   that does not match and reads again.
//! - **PUT** asks the server for memory (`request_remote`), RDMA-WRITEs the value into it and
//!   hands it over with the key as its tag; the server gets the buffer back (its rkey revoked),
//!   copies it into the slot, bumps the version and acknowledges with a SEND.
//!
//! Client tasks run concurrently, one connection each. A client that is done says goodbye with
//! a SEND, and only then does the server close that connection: the client may still be
//! READing the table. At the end the server checks every slot
//! against the deterministic plan (last value and number of PUTs per key), and the clients'
//! GETs check what they read.
//!
//! ```text
//! scripts/softroce -- cargo run --release --features tokio --example async_kv -- [--clients 4] [--ops 200]
//! ```

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::{fail, Args, Opt, Spec};
use hdrhistogram::Histogram;
use mralloc::heap::Exposed;
use mralloc::heap::Heap;
use mralloc::transfer::{AsyncConnection, AsyncListener, Options, QpOptions, RemoteLimits};
use mralloc::verbs::{Access, Pd};
use mralloc::RemoteBuf;

const KEYS_PER_CLIENT: usize = 8;
const VALUE: usize = 4096;
const HEADER: usize = 16;
const SLOT: usize = HEADER + VALUE;
/// A client's last message: it has finished reading the table.
const GOODBYE: u64 = u64::MAX;

static SPEC: Spec = Spec {
    name: "async_kv",
    about: "A key-value store on tokio: GET is one RDMA READ of the key's slot, PUT WRITEs into memory\n\
            requested from the server and hands it over; concurrent clients, final table verified.",
    no_role: "",
    roles: &[],
    opts: &[
        Opt::num("clients", "N", "client tasks, one connection each (default 4)"),
        Opt::num("ops", "N", "operations per client, PUTs and GETs alternating (default 200)"),
    ],
};

/// The value client `c` PUTs to `key` in its operation `i`.
fn value(c: usize, key: usize, i: usize) -> Vec<u8> {
    common::data(((c as u64) << 40) ^ ((key as u64) << 20) ^ i as u64, VALUE)
}

/// Client `c`'s operation `i` PUTs key `c + clients * (i / 2 % KEYS_PER_CLIENT)` when `i` is even
/// and GETs a key of the next client when it is odd.
fn put_key(c: usize, clients: usize, i: usize) -> usize {
    c + clients * (i / 2 % KEYS_PER_CLIENT)
}

/// FNV-1a over a slot's version and value: a torn read does not match.
fn checksum(version: u64, value: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ version;
    for &b in value {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn main() {
    let args = Args::parse(&SPEC);
    let (clients, ops) = (args.num("clients", 4), args.num("ops", 200));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // A watchdog: a stuck run reports instead of hanging.
    let r = rt.block_on(async { tokio::time::timeout(std::time::Duration::from_secs(240), run(clients, ops)).await });
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => fail(&format!("async_kv: {e}")),
        Err(_) => fail("async_kv: not finished within 240 s"),
    }
}

async fn run(clients: usize, ops: usize) -> Result<(), Box<dyn std::error::Error>> {
    let pd = Pd::new(&Options::default().open_device()?)?;
    // One heap: the table (exposed for remote reads), the memory lent to PUTs (memory windows)
    // and the clients' local buffers.
    let heap = Heap::builder().bind(&pd).access(Access::LOCAL_WRITE | Access::REMOTE_READ | Access::MW_BIND).build()?;
    let keys = clients * KEYS_PER_CLIENT;
    let table = Arc::new(heap.alloc_zeroed(keys * SLOT)?.expose()?);
    let opts = Options {
        qp: QpOptions { remote_access: Access::REMOTE_READ | Access::REMOTE_WRITE, ..Default::default() },
        ..Options::default()
    };
    let mut listener = AsyncListener::bind("127.0.0.1:0", &pd, opts.clone()).await?;
    // Every connection lends from the client's first request on.
    listener.serve_remote_memory(&heap, RemoteLimits { max_request: VALUE as u64, ..RemoteLimits::default() })?;
    let addr = listener.local_addr()?;
    let start = Instant::now();

    // The server: one task per connection, applying handed-over PUTs to the table.
    let server = {
        let (heap, table) = (heap.clone(), table.clone());
        tokio::spawn(async move {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..clients {
                let conn = listener.accept_with(&table.remote().to_bytes()).await?;
                tasks.spawn(serve(conn, heap.clone(), table.clone(), ops));
            }
            // In completion order: the first failure is reported at once.
            while let Some(r) = tasks.join_next().await {
                r.map_err(|e| mralloc::Error::Protocol(format!("a server task: {e}")))??;
            }
            Ok::<_, mralloc::Error>(())
        })
    };

    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let (pd, heap, opts) = (pd.clone(), heap.clone(), opts.clone());
        tasks.spawn(async move {
            let conn = AsyncConnection::connect(addr, &pd, opts).await?;
            client(conn, heap, c, clients, ops).await
        });
    }
    let clients_done = async {
        let (mut puts, mut gets) = (common::latencies(), common::latencies());
        while let Some(r) = tasks.join_next().await {
            let (p, g) = r.map_err(|e| mralloc::Error::Protocol(format!("a client task: {e}")))??;
            puts.add(p).expect("histograms with the same bounds");
            gets.add(g).expect("histograms with the same bounds");
        }
        Ok::<_, mralloc::Error>((puts, gets))
    };
    let server_done = async { server.await.map_err(|e| mralloc::Error::Protocol(format!("the server: {e}")))? };
    let ((put_t, get_t), ()) = tokio::try_join!(clients_done, server_done)?;

    // Every slot: the last value its owner PUT, and one version per PUT.
    for key in 0..keys {
        let (c, j) = (key % clients, key / clients);
        let puts: Vec<usize> = (0..ops).filter(|&i| i % 2 == 0 && put_key(c, clients, i) == key).collect();
        let mut slot = vec![0u8; SLOT];
        table.read_into(key * SLOT, &mut slot)?;
        let version = u64::from_le_bytes(slot[..8].try_into().unwrap());
        let want_value = puts.last().map_or(vec![0; VALUE], |&i| value(c, key, i));
        if version != puts.len() as u64 || slot[HEADER..] != want_value[..] {
            return Err(format!("key {key} (client {c}, slot {j}): version {version}, want {} PUTs", puts.len()).into());
        }
    }
    println!(
        "async_kv: {clients} clients x {ops} ops ({} PUTs into requested remote memory, {} GETs by RDMA READ) in {:?}; table verified",
        clients * ops.div_ceil(2),
        get_t.len(),
        start.elapsed()
    );
    println!("async_kv: PUT (request + write + hand over + ack) {}", common::percentiles(&put_t));
    println!("async_kv: GET (READ, repeated when torn) {}", common::percentiles(&get_t));
    Ok(())
}

/// The server side of one connection: each handed-over buffer is a PUT of its tag's key.
async fn serve(conn: AsyncConnection, heap: Heap, table: Arc<Exposed>, ops: usize) -> mralloc::Result<()> {
    let puts = ops.div_ceil(2);
    let mut ack = heap.alloc(8)?;
    for _ in 0..puts {
        let (key, buf) = conn.handed_over().await?;
        let key = key as usize;
        if (key + 1) * SLOT > table.len() || buf.len() != VALUE {
            return Err(mralloc::Error::Protocol(format!("a PUT of key {key} with {} bytes", buf.len())));
        }
        let mut version = [0u8; 8];
        table.read_into(key * SLOT, &mut version)?;
        let version = u64::from_le_bytes(version) + 1;
        let mut slot = Vec::with_capacity(SLOT);
        slot.extend_from_slice(&version.to_le_bytes());
        slot.extend_from_slice(&checksum(version, &buf).to_le_bytes());
        slot.extend_from_slice(&buf);
        table.write_from(key * SLOT, &slot)?;
        drop(buf); // back to the heap
        ack.copy_from_slice(&version.to_le_bytes());
        ack = conn.send(ack).await?;
    }
    let stats = conn.remote_memory_stats();
    if stats.lent_buffers != 0 {
        return Err(mralloc::Error::Protocol(format!("{} buffers still lent after the last PUT", stats.lent_buffers)));
    }
    // The client may still be READing the table: keep the connection until it says it is done
    // (a READ towards a destroyed queue pair would only fail at the client's keepalive).
    let (bye, got) = conn.recv(ack).await?;
    if got.len != 8 || bye[..] != GOODBYE.to_le_bytes() {
        return Err(mralloc::Error::Protocol("no goodbye from the client after its last PUT".into()));
    }
    conn.close().await
}

/// One client: PUTs through requested remote memory, GETs by READ. Returns the latencies of its
/// PUTs and of its GETs.
async fn client(
    conn: AsyncConnection,
    heap: Heap,
    c: usize,
    clients: usize,
    ops: usize,
) -> mralloc::Result<(Histogram<u64>, Histogram<u64>)> {
    let table = RemoteBuf::from_bytes(conn.peer_blob())?;
    let mut src = heap.alloc(VALUE)?;
    let mut slot = heap.alloc(SLOT)?;
    let mut ack = heap.alloc(8)?;
    let (mut put_t, mut get_t) = (common::latencies(), common::latencies());
    for i in 0..ops {
        if i % 2 == 0 {
            let key = put_key(c, clients, i);
            src.copy_from_slice(&value(c, key, i));
            let t = Instant::now();
            let acked = conn.recv(ack); // posted before the PUT: the server's SEND finds it
            let mem = conn.request_remote(VALUE as u64, Access::REMOTE_WRITE).await?;
            src = conn.write(src, &mem.remote(), 0).await?;
            conn.hand_over(mem, key as u64)?;
            let (back, _) = acked.await?;
            ack = back;
            common::record(&mut put_t, t.elapsed());
        } else {
            // GET a key of the next client: any version it has PUT so far, never a torn one.
            let owner = (c + 1) % clients;
            let key = owner + clients * (i / 2 % KEYS_PER_CLIENT);
            let t = Instant::now();
            loop {
                slot = conn.read(slot, &table, (key * SLOT) as u64).await?;
                let version = u64::from_le_bytes(slot[..8].try_into().unwrap());
                let sum = u64::from_le_bytes(slot[8..16].try_into().unwrap());
                if version == 0 && slot[HEADER..].iter().all(|&b| b == 0) {
                    common::record(&mut get_t, t.elapsed());
                    break; // not written yet
                }
                if sum == checksum(version, &slot[HEADER..]) {
                    // The GET is done; checking the value against the plan is not part of it.
                    common::record(&mut get_t, t.elapsed());
                    let plausible = (0..ops).any(|p| {
                        p % 2 == 0 && put_key(owner, clients, p) == key && slot[HEADER..] == value(owner, key, p)[..]
                    });
                    if !plausible {
                        return Err(mralloc::Error::Protocol(format!("GET of key {key} read a value nobody PUT")));
                    }
                    break;
                }
                // Raced with an update: read again.
            }
        }
    }
    // Done: a goodbye (all ones) tells the server it may close.
    ack.copy_from_slice(&GOODBYE.to_le_bytes());
    conn.send(ack).await?;
    conn.close().await?;
    Ok((put_t, get_t))
}
