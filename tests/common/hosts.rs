//! What `scripts/softroce --hosts N` tells each linked VM: its links (peer, local device,
//! addresses), and the network device under an rxe device.

/// One link of this host: to `peer`, over the local rxe `device`, between `local_ip` and
/// `peer_ip`.
pub struct Link {
    pub peer: usize,
    pub device: String,
    pub local_ip: String,
    pub peer_ip: String,
}

/// This host's links, from `MRALLOC_LINKS`.
pub fn links() -> Vec<Link> {
    let spec = std::env::var("MRALLOC_LINKS").expect("MRALLOC_LINKS: run under scripts/softroce --hosts N");
    spec.split_whitespace()
        .map(|e| {
            let f: Vec<&str> = e.split(':').collect();
            assert_eq!(f.len(), 4, "link entry {e}");
            Link { peer: f[0].parse().unwrap(), device: f[1].into(), local_ip: f[2].into(), peer_ip: f[3].into() }
        })
        .collect()
}

/// The network device an rxe device runs on (its GID 0's).
pub fn netdev_of(device: &str) -> String {
    let p = format!("/sys/class/infiniband/{device}/ports/1/gid_attrs/ndevs/0");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}")).trim().to_string()
}
