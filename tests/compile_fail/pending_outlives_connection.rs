// A Pending borrows its connection: the connection cannot be dropped while it lives.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let p = a.post_send(heap.alloc(64)?)?;
    drop(a);
    p.wait()?;
    Ok(())
}
