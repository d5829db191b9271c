// An UninitBuffer cannot be sent or written to a peer: it would show whatever the memory held.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let p = a.post_send(heap.alloc_uninit(64)?)?;
    p.wait()?;
    Ok(())
}
