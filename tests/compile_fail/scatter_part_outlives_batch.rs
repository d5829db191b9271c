// A batch borrows every part of a gather/scatter list until it is submitted: a part freed
// before that is a compile error, not memory the NIC reads after its free.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let remote = mralloc::RemoteBuf { addr: 0, len: 4096, rkey: 0 };
    let head = heap.alloc(64)?;
    let tail = heap.alloc(64)?;
    let list = [&head[..], &tail[..]];
    let mut batch = a.batch();
    batch.write(&list, &remote, 0)?;
    drop(tail);
    batch.submit()?;
    Ok(())
}
