// A buffer moved into a receive cannot be read (or freed) until the operation gives it back.
async fn recv(conn: &mralloc::transfer::AsyncConnection, heap: &mralloc::Heap) {
    let buf = heap.alloc(4096).unwrap();
    let op = conn.recv(buf);
    println!("{}", buf[0]);
    let _ = op.await;
}

fn main() {
    let _ = recv;
}
