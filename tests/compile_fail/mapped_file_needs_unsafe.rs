// Mapping a file is unsafe: another mapping or process could change the bytes behind the `&[u8]`
// views and the NIC. The caller has to promise it does not happen.
fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let f = mralloc::transfer::MappedFile::open("data.bin", mralloc::transfer::Mode::ReadOnly, &pd)?;
    drop(f);
    Ok(())
}
