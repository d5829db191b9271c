// A RegisteredBuf a peer may write is a RemoteWritable: it lends no `&[u8]` while its key lives
// (a peer's RDMA WRITE under a live shared reference is undefined behaviour).
use mralloc::verbs::{Access, Pd, RegisteredBuf};

fn f(pd: &Pd) -> mralloc::Result<()> {
    let buf = RegisteredBuf::new(pd, 4096, Access::LOCAL_WRITE)?.expose(Access::REMOTE_WRITE)?;
    let bytes: &[u8] = &buf[..]; // error: no references while the peer may write
    println!("{}", bytes[0]);
    Ok(())
}

fn main() {}
