// A READ into a borrowed Vec: forgetting the Pending would end the borrow while the NIC writes.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let mut v = vec![0u8; 4096];
    let remote = mralloc::RemoteBuf { addr: 0, len: 4096, rkey: 0 };
    let p = a.post_read(&mut v, &remote, 0)?;
    p.wait()?;
    Ok(())
}
