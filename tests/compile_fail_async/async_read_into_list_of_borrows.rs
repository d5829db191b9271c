// An async READ scattered into borrowed parts: a cancelled (dropped) future would end the
// borrows while the NIC may still write them, so only lists of owned targets are accepted.
async fn read(conn: &mralloc::transfer::AsyncConnection, remote: &mralloc::RemoteBuf, heap: &mralloc::Heap) {
    let (mut a, mut b) = (heap.alloc(16).unwrap(), heap.alloc(4096).unwrap());
    let _ = conn.read(vec![&mut a, &mut b], remote, 0).await;
}

fn main() {
    let _ = read;
}
