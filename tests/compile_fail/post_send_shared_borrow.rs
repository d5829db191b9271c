// A SEND on a shared borrow: the NIC could read the buffer after it was freed.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let buf = heap.alloc(64)?;
    let p = a.post_send(&buf)?;
    p.wait()?;
    Ok(())
}
