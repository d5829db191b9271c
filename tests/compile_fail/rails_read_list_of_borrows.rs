// A striped list READ into borrowed buffers: the list's buffers must be owned targets.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let rails = mralloc::transfer::Rails::new(vec![a], Default::default())?;
    let mut page = heap.alloc(4096)?;
    let remote = heap.alloc(4096)?.remote_desc()?;
    let t = rails.post_read_list(vec![(&mut page[..], remote)]);
    drop(t.wait());
    Ok(())
}
