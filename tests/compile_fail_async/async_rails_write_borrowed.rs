// An async striped WRITE from a borrowed buffer: a cancelled future would end the borrow while
// slices of it are on the wire.
async fn run(rails: &mralloc::transfer::AsyncRails, heap: &mralloc::heap::Heap) -> mralloc::Result<()> {
    let buf = heap.alloc(4096)?;
    let remote = buf.remote_desc()?;
    let done = rails.write(&buf, &remote, 0).await;
    drop(done);
    Ok(())
}

fn main() {
    let _ = run;
}
