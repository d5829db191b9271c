// A READ (or receive) scatters into its parts: each must be borrowed exclusively. A list of
// shared borrows is no Scatter target, so the NIC never writes memory someone else may read.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let buf = heap.alloc(4096)?;
    let remote = mralloc::RemoteBuf { addr: 0, len: 4096, rkey: 0 };
    let seen = &buf[..16];
    a.read(&mut [&buf[..16], &buf[16..32]], &remote, 0)?;
    assert_eq!(seen[0], 0);
    Ok(())
}
