//! What the kernel's RDMA resource tracker (`rdma resource show`) says of this process: its PDs,
//! and the QPs or MRs in them. Plain std, so the crate's own unit tests include it too
//! (`src/transfer/setup/tokio_wire_tests.rs`, by `#[path]`).

/// `rdma resource show <kind>`'s output.
pub fn rdma_res(kind: &str) -> String {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", kind])
        .output()
        .expect("running `rdma resource show`");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The kernel resource-tracker numbers of this process's PDs. (Its lines name the *thread* that
/// created an object, so PDs are found by this process's live thread ids, and QPs and MRs by PD.)
pub fn our_pdns() -> Vec<String> {
    let tids: Vec<String> = std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    rdma_res("pd")
        .lines()
        .filter(|l| tids.iter().any(|t| l.contains(&format!(" pid {t} "))))
        .filter_map(|l| l.split_whitespace().skip_while(|w| *w != "pdn").nth(1).map(str::to_owned))
        .collect()
}

/// QPs or MRs in this process's PDs, as the kernel's RDMA resource tracker sees them.
pub fn resources(kind: &str, pdns: &[String]) -> usize {
    rdma_res(kind).lines().filter(|l| pdns.iter().any(|p| l.contains(&format!(" pdn {p} ")))).count()
}
