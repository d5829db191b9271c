//! Exchanges across several hosts (Soft-RoCE VMs linked by `scripts/softroce --hosts N --links
//! T`): every host exchanges data with each neighbour over its own link (its own rxe device),
//! both directions, verified end to end. Run by scripts/test for star, ring and full mesh; each
//! host's run is one test. Outside such a boot (no MRALLOC_LINKS) the test fails: it is excluded
//! from the single-VM device run.

mod common;

use std::time::Duration;

use common::*;
use mralloc::heap::Heap;
use mralloc::transfer::{Connection, Listener, Options};
use mralloc::verbs::{Access, Context, Pd};
use mralloc::RemoteBuf;

struct Link {
    peer: usize,
    device: String,
    local_ip: String,
    peer_ip: String,
}

fn links() -> Vec<Link> {
    let spec = std::env::var("MRALLOC_LINKS").expect("MRALLOC_LINKS: run under scripts/softroce --hosts N");
    spec.split_whitespace()
        .map(|e| {
            let f: Vec<&str> = e.split(':').collect();
            assert_eq!(f.len(), 4, "link entry {e}");
            Link { peer: f[0].parse().unwrap(), device: f[1].into(), local_ip: f[2].into(), peer_ip: f[3].into() }
        })
        .collect()
}

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
                    device: Some(l.device.clone()),
                    op_timeout: Duration::from_secs(60),
                    // Each side's inbox is the target of the peer's write-with-immediate.
                    remote_access: Access::REMOTE_WRITE,
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
