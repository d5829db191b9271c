// Handing remote memory over gives it back to its owner: the handle is consumed, so nothing
// writes through it afterwards (a copied-out RemoteBuf only reaches a window the owner has
// invalidated before it takes the memory back).
async fn put(conn: &mralloc::transfer::AsyncConnection, heap: &mralloc::Heap) {
    let mem = conn.request_remote(4096, mralloc::verbs::Access::REMOTE_WRITE).await.unwrap();
    conn.hand_over(mem, 7).unwrap();
    let buf = heap.alloc(4096).unwrap();
    let _ = conn.write(buf, &mem.remote(), 0).await;
}

fn main() {
    let _ = put;
}
