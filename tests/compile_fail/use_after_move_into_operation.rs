// A buffer moved into an operation cannot be touched until the operation gives it back.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let mut buf = heap.alloc(4096)?;
    let remote = mralloc::RemoteBuf { addr: 0, len: 4096, rkey: 0 };
    let p = a.post_read(buf, &remote, 0)?;
    buf.fill(0); // the NIC may be writing it
    p.wait()?;
    Ok(())
}
