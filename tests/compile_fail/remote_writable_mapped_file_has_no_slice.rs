// A mapped file a peer may write (exposed) lends no `&[u8]` while its key lives; revoke first.
use mralloc::transfer::MappedFile;
use mralloc::verbs::Pd;

fn f(pd: &Pd) -> mralloc::Result<()> {
    // SAFETY: nothing else touches the file.
    let file = unsafe { MappedFile::create("out.bin", 4096, pd)? }.expose()?;
    let bytes: &[u8] = file.as_slice(); // error: no references while the peer may write
    println!("{}", bytes[0]);
    Ok(())
}

fn main() {}
