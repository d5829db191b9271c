//! The control channel: what its two tasks (`tasks`) and the connection's handles share. One
//! task keeps receives posted and answers the peer's messages (serving its requests for memory,
//! releasing what it gives back), one sends this side's messages in order and a keepalive when
//! the channel is quiet, so a dead peer is noticed.
//!
//! When the peer goes (a failed keepalive or message, its `Bye`, a failed data connection),
//! this side fails the data connection, waits for the device to flush it, and frees everything
//! it lent: with the queue pair in the error state nothing reaches that memory any more.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::mpsc::{channel, unbounded_channel, Receiver, Sender, UnboundedReceiver, UnboundedSender};
use tokio::sync::{oneshot, watch};

use crate::error::{Error, RemoteRefusal, Result};
use crate::heap::Buffer;
use crate::transfer::front::aio::lending::{Held, Lending, Lent, RemoteMemory};
use crate::transfer::front::aio::scratch::Words;
use crate::transfer::front::aio::wire::{Msg, RailKeys, FRAME};

mod tasks;
use crate::transfer::front::aio::{AsyncConnection, Shared};
use crate::verbs::Access;

/// How long a quiet control channel waits before checking on the peer with a `Ping`.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(1);
/// How long a control message may take to be acknowledged before the peer is declared gone. A
/// dead peer's queue pair may never make the device give up (Soft-RoCE retries a destroyed
/// peer's QP without end), so this side decides.
pub(crate) const PEER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a rails message waits for its side to make the rail group (a peer's group may be
/// ready a moment before this side's).
const GROUP_WAIT: Duration = Duration::from_secs(1);

/// The owner's answer to a request: the memory granted (built by the receive task, so a
/// cancelled request's grant is released by the handle's drop), or why not and its limit.
pub(crate) type Answer = std::result::Result<RemoteMemory, (RemoteRefusal, u64)>;
/// Memory granted over a rail group: address, length, a key per rail.
pub(crate) type RailsGrant = (u64, u64, RailKeys);
/// Takes the answer to a request for memory over a rail group (the group makes the handle).
pub(crate) type RailsReply = Box<dyn FnOnce(Result<RailsGrant>) + Send>;
/// Who waits for an answer: a request for this connection's memory, or a rail group's.
enum Reply {
    One(oneshot::Sender<Answer>),
    Rails(RailsReply),
}

/// What a rail group (`rails_lending`) does with the rails messages its rails' control channels
/// receive.
pub(crate) trait Group: Send + Sync {
    /// Answers the peer's request for `len` bytes with `access` over the group, on `on` (the
    /// control channel it came on), without holding up the caller.
    fn serve(self: Arc<Self>, seq: u64, len: u64, access: Access, on: Arc<ControlShared>);
    /// Memory the peer pushed over the group.
    ///
    /// # Errors
    /// [`Error::Protocol`] for memory the group cannot take (the keys are given back).
    fn pushed(&self, tag: u64, grant: RailsGrant, access: Access) -> Result<()>;
    /// Gives back memory granted over the group that nobody waits for.
    fn give_back(&self, grant: RailsGrant);
}
/// A request waiting for its answer: who waits, the rights and bytes asked for.
type Waiting = (Reply, Access, u64);
/// Bound on pushed grants the application has not taken yet: a peer beyond it breaks the
/// protocol (the connection is failed).
const PUSHED_INBOX: usize = 1024;

/// What the control tasks and the connection's handles share.
pub(crate) struct ControlShared {
    ctl: AsyncConnection,
    frames: Arc<Words>,
    out: UnboundedSender<Msg>,
    lending: Mutex<Lending>,
    /// Requests waiting for an answer: who waits, the rights and bytes asked for.
    requests: Mutex<HashMap<u64, Waiting>>,
    next_seq: AtomicU64,
    held: Arc<Held>,
    /// Set once the peer is gone: requests fail at once.
    dead: AtomicBool,
    /// Turns true once the peer is gone: ends both tasks.
    gone: watch::Sender<bool>,
    /// Whether the runtime has timers (keepalives, deadlines).
    timers: bool,
    pushed: tokio::sync::Mutex<Receiver<(u64, RemoteMemory)>>,
    handed: tokio::sync::Mutex<UnboundedReceiver<(u64, Buffer)>>,
    /// The rail group this connection is a rail of, if any (its remote memory spans them all).
    group: watch::Sender<Option<Arc<dyn Group>>>,
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
        group: watch::channel(None).0,
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
    tokio::spawn(tasks::receive(cs.clone(), weak.clone(), stop.clone(), parts.inboxes));
    tokio::spawn(tasks::send(cs.clone(), weak, stop, parts.out_rx));
}

impl ControlShared {
    /// Starts a request for `len` bytes with `access`; the answer arrives on the receiver.
    pub(crate) fn request(&self, len: u64, access: Access) -> Result<oneshot::Receiver<Answer>> {
        let (tx, rx) = oneshot::channel();
        self.ask(len, access, Reply::One(tx), |seq, len, access| Msg::Request { seq, len, access })?;
        Ok(rx)
    }

    /// Starts a request for `len` bytes with `access` through every rail of this connection's
    /// group; `reply` takes the answer (dropped untaken if the peer goes first).
    pub(crate) fn request_rails(&self, len: u64, access: Access, reply: RailsReply) -> Result<()> {
        self.ask(len, access, Reply::Rails(reply), |seq, len, access| Msg::RailsRequest { seq, len, access })
    }

    /// Registers a request's waiter and sends the request `msg` makes.
    fn ask(&self, len: u64, access: Access, reply: Reply, msg: fn(u64, u64, u8) -> Msg) -> Result<()> {
        let bits = crate::transfer::front::aio::lending::access_bits(access).ok_or_else(|| {
            Error::InvalidArgument("remote memory is granted with remote read and/or write rights".into())
        })?;
        if len == 0 {
            return Err(Error::InvalidArgument("remote memory of 0 bytes".into()));
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        self.requests.lock().insert(seq, (reply, access, len));
        if self.dead.load(Ordering::Acquire) || self.out.send(msg(seq, len, bits)).is_err() {
            self.requests.lock().remove(&seq);
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Queues `msg` for the peer.
    ///
    /// # Errors
    /// [`Error::Closed`] if the channel is gone (its tasks ended).
    pub(crate) fn tell(&self, msg: Msg) -> Result<()> {
        self.out.send(msg).map_err(|_| Error::Closed)
    }

    /// A sender of messages to the peer, for a handle that tells it when it goes.
    pub(crate) fn sender(&self) -> UnboundedSender<Msg> {
        self.out.clone()
    }

    /// Whether `out` sends on this channel.
    pub(crate) fn sends_with(&self, out: &UnboundedSender<Msg>) -> bool {
        out.same_channel(&self.out)
    }

    /// This side's handles on the peer's memory.
    pub(crate) fn held(&self) -> &Held {
        &self.held
    }

    /// The next memory the peer pushed (`None` once the channel is gone).
    pub(crate) async fn next_pushed(&self) -> Option<(u64, RemoteMemory)> {
        self.pushed.lock().await.recv().await
    }

    /// The next buffer the peer handed over (`None` once the channel is gone).
    pub(crate) async fn next_handed(&self) -> Option<(u64, Buffer)> {
        self.handed.lock().await.recv().await
    }

    /// What this side lends through the connection.
    pub(crate) fn lending(&self) -> &Mutex<Lending> {
        &self.lending
    }

    /// Makes this connection a rail of `group`.
    pub(crate) fn set_group(&self, group: Arc<dyn Group>) {
        self.group.send_replace(Some(group));
    }

    /// The rail group this connection is a rail of. A rail's messages may arrive before its
    /// side has made the group (the peer's group was ready first): they wait for it, up to
    /// [`GROUP_WAIT`] (not at all without timers), or until the peer is gone.
    async fn group(&self) -> Option<Arc<dyn Group>> {
        let mut rx = self.group.subscribe();
        if let Some(g) = rx.borrow_and_update().clone() {
            return Some(g);
        }
        if !self.timers {
            return None;
        }
        let mut gone = self.gone.subscribe();
        let wait = tokio::time::timeout(GROUP_WAIT, rx.wait_for(Option::is_some));
        let got = tokio::select! {
            _ = gone.wait_for(|g| *g) => None,
            got = wait => match got {
                Ok(Ok(g)) => g.clone(),
                _ => None,
            },
        };
        got
    }

    /// Buffers and bytes lent through the connection now, and how many were told to the peer
    /// so far.
    pub(crate) fn lent(&self) -> (usize, u64, u64) {
        self.lending.lock().counts()
    }

    /// Whether the peer is gone.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Whether lending `len` more bytes stays within `limits` (see [`Lending::room`]).
    pub(crate) fn room(&self, len: u64, limits: &crate::transfer::RemoteLimits) -> std::result::Result<(), u64> {
        self.lending.lock().room(len, limits)
    }

    /// Marks entry `handle` as told to the peer (see [`Lending::announce`]).
    pub(crate) fn announce(&self, handle: u64) {
        self.lending.lock().announce(handle);
    }

    /// Frees everything lent, for a connection that is gone: parked until its QP is destroyed.
    pub(crate) fn take_lent(&self) -> HashMap<u64, Lent> {
        self.lending.lock().take_all()
    }
}
