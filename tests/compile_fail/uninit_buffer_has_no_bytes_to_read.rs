// An UninitBuffer does not deref to bytes: nothing can read memory nobody wrote.
fn main() -> mralloc::Result<()> {
    let heap = mralloc::heap::Heap::builder().build()?;
    let u = heap.alloc_uninit(64)?;
    let first: u8 = u[0];
    let all: &[u8] = &u;
    println!("{first} {}", all.len());
    Ok(())
}
