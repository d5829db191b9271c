// The scenario that let a peer overwrite the next owner of a buffer: a receive posted on a
// borrowed buffer, the Pending forgotten, the buffer freed. It no longer compiles.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (_a, b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    {
        let mut r = heap.alloc(4096)?;
        let p = b.post_recv(&mut r).map_err(|e| e.error)?;
        std::mem::forget(p);
    }
    Ok(())
}
