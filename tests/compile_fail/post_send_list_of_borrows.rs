// A gathered SEND from borrowed parts: forgetting the Pending would end the borrows while the
// NIC still reads them. A list's parts must be owned, as a single buffer must be.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let (header, payload) = (heap.alloc(16)?, heap.alloc(4096)?);
    let p = a.post_send(vec![&header, &payload])?;
    std::mem::forget(p);
    drop((header, payload)); // freed while the NIC may still read them
    Ok(())
}
