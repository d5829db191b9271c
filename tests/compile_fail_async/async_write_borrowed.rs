// An async WRITE from a borrowed slice: a cancelled (dropped) future would end the borrow while
// the NIC may still read it, so only owned IoBufs are accepted.
async fn send(conn: &mralloc::transfer::AsyncConnection, remote: &mralloc::RemoteBuf, heap: &mralloc::Heap) {
    let buf = heap.alloc(4096).unwrap();
    let _ = conn.write(&buf[..100], remote, 0).await;
}

fn main() {
    let _ = send;
}
