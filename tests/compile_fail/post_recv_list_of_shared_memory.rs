// A scattered receive into shared, read-only memory: other owners of an `Arc` read the bytes
// the NIC would write. A READ's or receive's parts must each be owned and writable.
use std::sync::Arc;

fn main() -> mralloc::Result<()> {
    let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
    let heap = mralloc::heap::Heap::new(&pd)?;
    let (a, _b) = mralloc::transfer::Connection::pair(&pd, &Default::default())?;
    let shared = Arc::new(heap.alloc(4096)?);
    let p = a.post_recv(vec![shared.clone(), Arc::new(heap.alloc(64)?)])?;
    assert_eq!(shared[0], 0);
    p.wait()?;
    Ok(())
}
