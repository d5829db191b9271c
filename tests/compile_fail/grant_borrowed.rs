// A grant over a borrowed buffer: a forgotten Grant would leave the peer write access to it
// after it was freed.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let mut buf = heap.alloc(4096)?;
    let g = a.grant(&mut buf, mralloc::verbs::Access::REMOTE_WRITE)?;
    drop(g);
    Ok(())
}
