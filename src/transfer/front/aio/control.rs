//! The control channel's two tasks: one keeps receives posted and answers the peer's messages
//! (serving its requests for memory, releasing what it gives back), one sends this side's
//! messages in order and a keepalive when the channel is quiet, so a dead peer is noticed.
//!
//! When the peer goes (a failed keepalive or message, its `Bye`, a failed data connection),
//! this side fails the data connection, waits for the device to flush it, and frees everything
//! it lent: with the queue pair in the error state nothing reaches that memory any more.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::mpsc::{channel, unbounded_channel, Receiver, Sender, UnboundedReceiver, UnboundedSender};
use tokio::sync::{oneshot, watch};

use crate::error::{Error, RemoteRefusal, Result};
use crate::heap::Buffer;
use crate::remote::RemoteBuf;
use crate::transfer::connection::FLUSH_WAIT;
use crate::transfer::engine::completion::Failure;
use crate::transfer::exact::Keyed;
use crate::transfer::front::aio::lending::{access_of, Held, Lending, Lent, RemoteMemory};
use crate::transfer::front::aio::op::{NoBytes, Op};
use crate::transfer::front::aio::scratch::{Word, Words};
use crate::transfer::front::aio::wire::{Msg, FRAME};
use crate::transfer::front::aio::{AsyncConnection, Shared};
use crate::transfer::setup::control::DEPTH;
use crate::transfer::{Received, Rejected};
use crate::verbs::Access;

/// How long a quiet control channel waits before checking on the peer with a `Ping`.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(1);
/// How long a control message may take to be acknowledged before the peer is declared gone. A
/// dead peer's queue pair may never make the device give up (Soft-RoCE retries a destroyed
/// peer's QP without end), so this side decides.
pub(crate) const PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// The owner's answer to a request: the memory granted (built by the receive task, so a
/// cancelled request's grant is released by the handle's drop), or why not and its limit.
pub(crate) type Answer = std::result::Result<RemoteMemory, (RemoteRefusal, u64)>;
/// A request waiting for its answer: who waits, the rights and bytes asked for.
type Waiting = (oneshot::Sender<Answer>, Access, u64);
/// Bound on pushed grants the application has not taken yet: a peer beyond it breaks the
/// protocol (the connection is failed).
const PUSHED_INBOX: usize = 1024;

/// What the control tasks and the connection's handles share.
pub(crate) struct ControlShared {
    pub(crate) ctl: AsyncConnection,
    frames: Arc<Words>,
    pub(crate) out: UnboundedSender<Msg>,
    pub(crate) lending: Mutex<Lending>,
    /// Requests waiting for an answer: who waits, the rights and bytes asked for.
    requests: Mutex<HashMap<u64, Waiting>>,
    next_seq: AtomicU64,
    pub(crate) held: Arc<Held>,
    /// Set once the peer is gone: requests fail at once.
    pub(crate) dead: AtomicBool,
    /// Turns true once the peer is gone: ends both tasks.
    gone: watch::Sender<bool>,
    /// Whether the runtime has timers (keepalives, deadlines).
    timers: bool,
    pub(crate) pushed: tokio::sync::Mutex<Receiver<(u64, RemoteMemory)>>,
    pub(crate) handed: tokio::sync::Mutex<UnboundedReceiver<(u64, Buffer)>>,
}

/// What only the tasks hold: dropping them (the tasks end) closes `pushed` and `handed`.
struct Inboxes {
    pushed: Sender<(u64, RemoteMemory)>,
    handed: UnboundedSender<(u64, Buffer)>,
}

/// Sets up the control channel's state for `ctl` (already async). Returns it, the outgoing
/// queue's receiver and the inboxes' senders, for [`spawn`].
pub(crate) fn new(ctl: AsyncConnection) -> (Arc<ControlShared>, Parts) {
    let (out, out_rx) = unbounded_channel();
    let (pushed_tx, pushed_rx) = channel(PUSHED_INBOX);
    let (handed_tx, handed_rx) = unbounded_channel();
    let frames = Words::new(ctl.pd(), FRAME);
    // A runtime without timers gets no keepalive (tokio panics on a timer there).
    let timers = super::reactor::has_timers();
    if !timers {
        tracing::warn!("no tokio timers (enable_time): the control channel sends no keepalives");
    }
    let cs = Arc::new(ControlShared {
        ctl,
        frames,
        out,
        lending: Mutex::new(Lending::default()),
        requests: Mutex::new(HashMap::new()),
        next_seq: AtomicU64::new(1),
        held: Arc::new(Held::default()),
        dead: AtomicBool::new(false),
        gone: watch::channel(false).0,
        timers,
        pushed: tokio::sync::Mutex::new(pushed_rx),
        handed: tokio::sync::Mutex::new(handed_rx),
    });
    (cs, Parts { out_rx, inboxes: Inboxes { pushed: pushed_tx, handed: handed_tx } })
}

/// What [`new`] hands to [`spawn`].
pub(crate) struct Parts {
    out_rx: UnboundedReceiver<Msg>,
    inboxes: Inboxes,
}

/// Starts the two tasks. They end when `stop`'s sender (held by the data connection) is gone.
pub(crate) fn spawn(cs: &Arc<ControlShared>, data: &Arc<Shared>, parts: Parts, stop: watch::Receiver<()>) {
    let weak = Arc::downgrade(data);
    tokio::spawn(receive(cs.clone(), weak.clone(), stop.clone(), parts.inboxes));
    tokio::spawn(send(cs.clone(), weak, stop, parts.out_rx));
}

type RecvFuture = Pin<Box<dyn Future<Output = std::result::Result<(Word, Received), Rejected<Word>>> + Send>>;

async fn receive(cs: Arc<ControlShared>, weak: Weak<Shared>, mut stop: watch::Receiver<()>, inboxes: Inboxes) {
    let mut ring: VecDeque<RecvFuture> = VecDeque::with_capacity(DEPTH as usize);
    for _ in 0..DEPTH {
        match cs.frames.take() {
            Ok(w) => ring.push_back(Box::pin(cs.ctl.recv(w))),
            Err(e) => return peer_gone(&cs, &weak, e).await,
        }
    }
    let mut gone = cs.gone.subscribe();
    loop {
        let next = ring.pop_front().expect("the ring is refilled after every message");
        let got = tokio::select! {
            _ = stop.changed() => return,
            _ = gone.wait_for(|g| *g) => return,
            got = next => got,
        };
        let (word, received) = match got {
            Ok(x) => x,
            Err(rejected) => return peer_gone(&cs, &weak, rejected.error).await,
        };
        let msg = Msg::decode(&word.bytes()[..received.len]);
        ring.push_back(Box::pin(cs.ctl.recv(word)));
        let msg = match msg {
            Ok(m) => m,
            Err(e) => return peer_gone(&cs, &weak, e).await,
        };
        if let Msg::Bye = msg {
            return peer_gone(&cs, &weak, Error::Closed).await;
        }
        let Some(sh) = weak.upgrade() else { return };
        if let Err(e) = handle(&cs, &sh, msg, &inboxes).await {
            drop(sh);
            return peer_gone(&cs, &weak, e).await;
        }
    }
}

/// Acts on one message; `Err`: the peer broke the protocol.
async fn handle(cs: &Arc<ControlShared>, sh: &Arc<Shared>, msg: Msg, inboxes: &Inboxes) -> Result<()> {
    match msg {
        Msg::Request { seq, len, access } => {
            let answer = serve(cs, sh, seq, len, access_of(access)).await;
            let _ = cs.out.send(answer);
        }
        Msg::Granted { seq, handle, remote } => {
            let waiting = cs.requests.lock().remove(&seq);
            let Some((tx, access, len)) = waiting else {
                // Nobody asked (or the answer came after the peer was declared gone): give it back.
                let _ = cs.out.send(Msg::Release { handle });
                return Ok(());
            };
            if remote.len != len {
                let _ = cs.out.send(Msg::Release { handle });
                return Err(Error::Protocol(format!("control channel: {len} bytes asked for, {} granted", remote.len)));
            }
            // If nobody waits any more (a cancelled request), the handle's drop gives it back.
            let _ = tx.send(Ok(RemoteMemory::new(remote, handle, access, cs.out.clone(), cs.held.clone())));
        }
        Msg::Refused { seq, code, limit } => {
            if let Some((tx, _, _)) = cs.requests.lock().remove(&seq) {
                let _ = tx.send(Err((code, limit)));
            }
        }
        Msg::Release { handle } => drop(unlend(cs, sh, handle).await),
        Msg::HandOver { handle, tag } => {
            if let Some(buf) = unlend(cs, sh, handle).await {
                let mut l = cs.lending.lock();
                l.handed.0 += 1;
                l.handed.1 += buf.len() as u64;
                drop(l);
                let _ = inboxes.handed.send((tag, buf));
            }
        }
        Msg::Push { handle, remote, access, tag } => {
            let mem = RemoteMemory::new(remote, handle, access_of(access), cs.out.clone(), cs.held.clone());
            if let Err(tokio::sync::mpsc::error::TrySendError::Full(_)) = inboxes.pushed.try_send((tag, mem)) {
                return Err(Error::Protocol(format!(
                    "control channel: more than {PUSHED_INBOX} pushed grants not taken by the application"
                )));
            }
        }
        Msg::Ping | Msg::Bye => {}
    }
    Ok(())
}

/// The answer to a request for `len` bytes with `access`.
async fn serve(cs: &Arc<ControlShared>, sh: &Arc<Shared>, seq: u64, len: u64, access: Access) -> Msg {
    let refuse = |code, limit| Msg::Refused { seq, code, limit };
    let Some((heap, limits)) = cs.lending.lock().serving.clone() else {
        return refuse(RemoteRefusal::NotServing, 0);
    };
    if len > limits.max_request {
        return refuse(RemoteRefusal::TooLarge, limits.max_request);
    }
    if !sh.conn().options().qp.remote_access.contains(access) || !heap.access().contains(Access::MW_BIND) {
        return refuse(RemoteRefusal::Rights, 0);
    }
    if let Err(left) = cs.lending.lock().room(len, &limits) {
        return refuse(RemoteRefusal::LimitReached, left);
    }
    // Zeroed: the peer must not read what this heap's earlier owners left.
    let Ok(buf) =
        usize::try_from(len).map_err(|_| Error::InvalidArgument(String::new())).and_then(|n| heap.alloc_zeroed(n))
    else {
        return refuse(RemoteRefusal::OutOfMemory, 0);
    };
    match lend(cs, sh, buf, access).await {
        Ok((handle, remote)) => {
            cs.lending.lock().announce(handle);
            Msg::Granted { seq, handle, remote }
        }
        Err(_) => refuse(RemoteRefusal::Unavailable, 0),
    }
}

/// Makes a key for exactly `buf` with `access` (see `transfer::exact`: a window bound through
/// this connection) and registers the entry. The entry is in the registry before the bind is
/// posted, so a cancelled bind leaves it there (released with the connection). On failure the
/// buffer comes back unless the bind's flush was lost.
pub(crate) async fn lend(
    cs: &ControlShared,
    sh: &Arc<Shared>,
    buf: Buffer,
    access: Access,
) -> std::result::Result<(u64, RemoteBuf), Rejected<Buffer>> {
    let ctx = sh.conn().pd().context();
    if ctx.confinement_settled().is_none() {
        // The device's first grant probes it (milliseconds of verbs calls): not on this thread.
        let (ctx, qp) = (ctx.clone(), sh.conn().qp());
        let at = Some((qp.port(), qp.gid_index()));
        let _ = tokio::task::spawn_blocking(move || ctx.confines_windows_on(at)).await;
    }
    let (bind, handle, remote) = start_lend(cs, sh, buf, access)?;
    match bind.await {
        Ok(_) => Ok((handle, remote)),
        // Refused, or failed and flushed: the window is not bound, the memory is ours again
        // (unless the connection's failure path already took it).
        Err(Rejected { error, buf: Some(_) }) => {
            let lent = cs.lending.lock().remove(handle);
            Err(Rejected { error, buf: lent.and_then(|l| l.keyed.into_buf().ok()) })
        }
        // The flush never came: the entry stays (parked with the connection, never freed early).
        Err(Rejected { error, buf: None }) => Err(Rejected { error, buf: None }),
    }
}

/// Makes the key, registers the entry, and posts the window's bind (no await: the verbs
/// handles stay out of the future's state). Returns the bind in flight, the entry's handle and
/// what the peer needs.
fn start_lend(
    cs: &ControlShared,
    sh: &Arc<Shared>,
    buf: Buffer,
    access: Access,
) -> std::result::Result<(Op<NoBytes>, u64, RemoteBuf), Rejected<Buffer>> {
    let (keyed, bind) = Keyed::prepare(sh.conn(), buf, access)?;
    let remote = keyed.remote();
    let handle = cs.lending.lock().insert(Lent { keyed, announced: false });
    let op = Op::control(sh.clone(), bind);
    Ok((op, handle, remote))
}

/// Kills the key of `handle` (the window's invalidation) and takes its buffer out of the
/// registry. `None` if the handle is unknown, not announced yet (its bind is in flight: a peer
/// that names it breaks nothing), or the key could not be killed (a failed invalidation fails
/// the connection, whose failure path frees the entry once the queue pair is flushed), or an
/// exact registration the device refused to remove (the buffer is leaked).
async fn unlend(cs: &ControlShared, sh: &Arc<Shared>, handle: u64) -> Option<Buffer> {
    let revocation = cs.lending.lock().lent.get(&handle).filter(|l| l.announced).map(|l| l.keyed.revocation())?;
    Op::control(sh.clone(), revocation).await.ok()?;
    let lent = cs.lending.lock().remove(handle)?;
    lent.keyed.into_buf().ok()
}

async fn send(
    cs: Arc<ControlShared>,
    weak: Weak<Shared>,
    mut stop: watch::Receiver<()>,
    mut out: UnboundedReceiver<Msg>,
) {
    let mut gone = cs.gone.subscribe();
    loop {
        let next = async {
            if cs.timers {
                tokio::time::timeout(KEEPALIVE, out.recv()).await.unwrap_or(Some(Msg::Ping))
            } else {
                out.recv().await
            }
        };
        let msg = tokio::select! {
            _ = stop.changed() => return,
            _ = gone.wait_for(|g| *g) => return,
            m = next => m,
        };
        let Some(msg) = msg else { return };
        if let Msg::Ping = msg {
            // A quiet moment: is the data connection still good?
            match weak.upgrade() {
                Some(sh) if sh.conn().error().is_some() => return peer_gone(&cs, &weak, Error::Closed).await,
                Some(_) => {}
                None => return,
            }
        }
        let mut frame = match cs.frames.take() {
            Ok(w) => w,
            Err(e) => return peer_gone(&cs, &weak, e).await,
        };
        frame.fill(&msg.encode());
        let sent = async {
            let sent = cs.ctl.send(frame);
            if !cs.timers {
                return sent.await.map(drop).map_err(|r| r.error);
            }
            match tokio::time::timeout(PEER_TIMEOUT, sent).await {
                Ok(r) => r.map(drop).map_err(|r| r.error),
                // The frame is parked with the control connection until its flush.
                Err(_) => Err(Error::Timeout(PEER_TIMEOUT, "the peer to acknowledge a control message")),
            }
        };
        let sent = tokio::select! {
            _ = stop.changed() => return,
            _ = gone.wait_for(|g| *g) => return,
            r = sent => r,
        };
        if let Err(e) = sent {
            return peer_gone(&cs, &weak, e).await;
        }
        if let Msg::Bye = msg {
            return;
        }
    }
}

/// The peer is gone (or broke the protocol, or this side's data connection failed): fail the
/// data connection, let the device flush it, free what was lent, fail waiting requests.
async fn peer_gone(cs: &ControlShared, weak: &Weak<Shared>, why: Error) {
    if cs.dead.swap(true, Ordering::AcqRel) {
        return;
    }
    tracing::debug!("control channel: the peer is gone ({why}); releasing remote memory");
    // Both tasks end; the control queue pair goes to the error state, so the peer's next
    // message (its keepalive at the latest) fails and it releases on its side too.
    cs.gone.send_replace(true);
    cs.ctl.shared.conn().fail(Failure::Closed);
    let sh = weak.upgrade();
    if let Some(sh) = &sh {
        sh.conn().fail(match &why {
            Error::Operation { op, wr_id, status, vendor_err } => {
                Failure::Op { op, wr_id: *wr_id, status: *status, vendor_err: *vendor_err }
            }
            Error::Closed => Failure::Closed,
            e => Failure::local(e),
        });
    }
    // Waiting requests fail with the connection's error (it is recorded first).
    cs.requests.lock().clear();
    let Some(sh) = sh else { return };
    let conn = sh.conn();
    // Every key of lent memory is a window bound through this queue pair: nothing reaches that
    // memory through a queue pair in the error state. Wait for the flush of what is
    // outstanding (binds and invalidations among it) before freeing it.
    if conn.qp().set_error().is_err() {
        return; // kept until the connection is dropped (released after its close's flush)
    }
    let start = Instant::now();
    loop {
        let _ = conn.core().drain();
        sh.pump();
        if conn.core().quiet() {
            break;
        }
        if start.elapsed() > FLUSH_WAIT {
            return;
        }
        if cs.timers {
            tokio::time::sleep(Duration::from_millis(1)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
    drop(cs.take_lent());
}

impl ControlShared {
    /// Starts a request for `len` bytes with `access`; the answer arrives on the receiver.
    pub(crate) fn request(&self, len: u64, access: Access) -> Result<oneshot::Receiver<Answer>> {
        let bits = crate::transfer::front::aio::lending::access_bits(access).ok_or_else(|| {
            Error::InvalidArgument("remote memory is granted with remote read and/or write rights".into())
        })?;
        if len == 0 {
            return Err(Error::InvalidArgument("remote memory of 0 bytes".into()));
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.requests.lock().insert(seq, (tx, access, len));
        if self.dead.load(Ordering::Acquire) || self.out.send(Msg::Request { seq, len, access: bits }).is_err() {
            self.requests.lock().remove(&seq);
            return Err(Error::Closed);
        }
        Ok(rx)
    }

    /// Frees everything lent, for a connection that is gone: parked until its QP is destroyed.
    pub(crate) fn take_lent(&self) -> HashMap<u64, Lent> {
        self.lending.lock().take_all()
    }
}
