// A buffer a peer may write has no references to its bytes: once exposed, it cannot be read or
// written as a slice (the NIC may change the bytes under the reference at any moment).
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::builder().bind(&pd).access(mralloc::verbs::Access::ALL_REMOTE).build()?;
    let inbox = heap.alloc(4096)?.expose()?;
    let first: u8 = inbox[0];
    println!("{first}");
    Ok(())
}
