// A striped WRITE from a borrowed slice: a dropped or forgotten Striped would end the borrow
// while slices of it are on the wire, so only owned buffers qualify.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let rails = mralloc::transfer::Rails::new(vec![a], Default::default())?;
    let buf = heap.alloc(4096)?;
    let remote = buf.remote_desc()?;
    let t = rails.post_write(&buf[..100], &remote, 0)?;
    drop(t.wait());
    Ok(())
}
