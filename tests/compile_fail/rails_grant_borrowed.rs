// A rails grant of a borrowed buffer: a dropped or forgotten RailsGrant would end the borrow
// while the peer may still write the bytes through any rail's key, so only owned buffers
// qualify.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let rails = mralloc::transfer::Rails::new(vec![a], Default::default())?;
    let mut buf = heap.alloc(4096)?;
    let grant = rails.grant(&mut buf, mralloc::verbs::Access::REMOTE_WRITE).map_err(|r| r.error)?;
    drop(grant.desc());
    Ok(())
}
