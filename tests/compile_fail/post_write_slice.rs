// A WRITE from a plain slice of a buffer: borrowed, so not an owned IoBuf.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let buf = heap.alloc(4096)?;
    let remote = mralloc::RemoteBuf { addr: 0, len: 4096, rkey: 0 };
    let p = a.post_write(&buf[..100], &remote, 0)?;
    p.wait()?;
    Ok(())
}
