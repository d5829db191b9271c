//! `devices`: an `ibv_devinfo`-like listing — devices, ports, GID tables, NUMA nodes.
//!
//! ```text
//! scripts/softroce -- cargo run --release --example devices
//! ```

mod common;

use common::{Args, Spec};
use mralloc::verbs::{devices, Context};

static SPEC: Spec = Spec {
    name: "devices",
    about: "Lists the RDMA devices (an ibv_devinfo-like listing): ports, GID tables, NUMA nodes.",
    no_role: "",
    roles: &[],
    opts: &[],
};

fn main() {
    Args::parse(&SPEC); // only --help: any argument is an error
    if let Err(e) = run() {
        eprintln!("devices: {e}");
        std::process::exit(1);
    }
}

fn run() -> mralloc::Result<()> {
    let list = devices()?;
    if list.is_empty() {
        eprintln!("no RDMA devices on this machine; run it under scripts/softroce for a Soft-RoCE device");
        std::process::exit(1);
    }
    for info in list {
        println!("{}", info.name);
        println!("  node GUID      {:016x}", info.guid);
        match info.numa_node {
            Some(n) => println!("  NUMA node      {n}"),
            None => println!("  NUMA node      none (virtual device or not reported)"),
        }
        let ctx = Context::open(&info.name)?;
        let attr = ctx.attributes()?;
        println!("  max QPs        {}", attr.max_qp);
        println!("  max MR size    {} bytes", attr.max_mr_size);
        println!("  max RD atomic  {} (initiator {})", attr.max_qp_rd_atom, attr.max_qp_init_rd_atom);
        for port in 1..=ctx.port_count()? {
            let p = ctx.port(port)?;
            println!(
                "  port {port}: {:?}, {:?} link, {}, active MTU {} (max {}), LID {}",
                p.state,
                p.link_layer,
                p.gbps().map_or(format!("rate codes {}/{}", p.active_width, p.active_speed), |g| format!("{g} Gb/s")),
                p.active_mtu.bytes(),
                p.max_mtu.bytes(),
                p.lid
            );
            for g in ctx.gid_table(port)? {
                println!("    GID[{:3}] {:<40} {}", g.index, g.gid.to_string(), g.kind.as_deref().unwrap_or(""));
            }
            if let Ok(i) = ctx.default_gid_index(port) {
                println!("    default GID index: {i}");
            }
        }
    }
    Ok(())
}
