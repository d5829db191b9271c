//! The tokio handshakes connect their queue pairs (RTR/RTS, which may block on a device) on the
//! blocking pool: the runtime's one worker goes on serving other tasks meanwhile, and a connect
//! or accept future dropped while the step runs leaves no queue pair behind. The step is held
//! by a test hook (`control::hold`) to stand for a slow device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transfer::setup::control::hold;
use crate::transfer::{AsyncConnection, AsyncListener, Options};
use crate::verbs::{Context, Pd};

#[path = "../../../tests/common/rdma_res.rs"]
mod rdma_res;
use rdma_res::{our_pdns, resources};

/// QPs in `pdns`, as the kernel sees them.
fn qps(pdns: &[String]) -> usize {
    resources("qp", pdns)
}

/// Waits on the runtime (every 10 ms, at most 10 s) until `done()` holds: each round needs the
/// runtime's worker.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device: run scripts/test"]
async fn device_tokio_handshakes_connect_off_the_worker_and_dropped_futures_leave_no_qp() {
    let pd = Pd::new(&Context::open_default().expect("an RDMA device")).unwrap();
    let listener = Arc::new(AsyncListener::bind("127.0.0.1:0", &pd, Options::default()).await.unwrap());
    let addr = listener.local_addr().unwrap();
    let pdns = our_pdns();
    assert!(!pdns.is_empty(), "this process's PD is tracked");
    let before = qps(&pdns);

    // 1. The client's step (the first to start: it connects its QPs before saying Ready) is
    // held, and its connect future dropped meanwhile.
    hold::arm(1);
    let l = listener.clone();
    let accept = tokio::spawn(async move { l.accept().await });
    let client_pd = pd.clone();
    let connect = tokio::spawn(async move { AsyncConnection::connect(addr, &client_pd, Options::default()).await });
    // A current_thread runtime: if the step ran in place, this loop (on the same worker) would
    // not run until the step was over, and would never see it held.
    until("the client's connect step held, seen from the runtime's one worker", hold::held).await;
    assert!(qps(&pdns) > before, "the handshake's queue pairs exist while the step runs");
    connect.abort();
    assert!(connect.await.unwrap_err().is_cancelled());
    hold::release();
    // The step owned the client's QPs and drops them once done; the server's handshake fails
    // on the closed stream and drops its own.
    until("the cancelled handshake's queue pairs destroyed", || qps(&pdns) == before).await;
    assert!(!accept.is_finished(), "a client's failure never ends an accept call");

    // 2. The server's step held, and the accept future dropped meanwhile.
    hold::arm(2);
    let client_pd = pd.clone();
    let connect = tokio::spawn(async move { AsyncConnection::connect(addr, &client_pd, Options::default()).await });
    until("the server's connect step held", hold::held).await;
    accept.abort();
    assert!(accept.await.unwrap_err().is_cancelled());
    hold::release();
    // The handshake finishes; its connection goes with the answer nobody reads, and the
    // client, connected, sees it go.
    let client = connect.await.unwrap().expect("the client's setup completes");
    until("the client sees the dropped accept's connection go", || client.error().is_some()).await;
    drop(client);
    until("every queue pair destroyed", || qps(&pdns) == before).await;
    drop(listener);
}
