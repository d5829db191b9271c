//! The control channel's two tasks (see the module above): receiving and acting on the peer's
//! messages, sending this side's with keepalives; and what happens when the peer is gone.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;

use crate::error::{Error, RemoteRefusal, Result};
use crate::transfer::connection::FLUSH_WAIT;
use crate::transfer::engine::completion::Failure;
use crate::transfer::front::aio::lending::{access_of, lend, unlend, Kept, RemoteMemory};
use crate::transfer::front::aio::scratch::Word;
use crate::transfer::front::aio::wire::{Msg, RailKeys};
use crate::transfer::front::aio::Shared;
use crate::transfer::setup::control::DEPTH;
use crate::transfer::{Received, Rejected};
use crate::verbs::Access;

use super::{ControlShared, Inboxes, Reply, KEEPALIVE, PEER_TIMEOUT, PUSHED_INBOX};

type RecvFuture = Pin<Box<dyn Future<Output = std::result::Result<(Word, Received), Rejected<Word>>> + Send>>;

pub(super) async fn receive(
    cs: Arc<ControlShared>,
    weak: Weak<Shared>,
    mut stop: watch::Receiver<()>,
    inboxes: Inboxes,
) {
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
            let Some((Reply::One(tx), access, len)) = waiting else {
                // Nobody asked (or the answer came after the peer was declared gone): give it back.
                let _ = cs.out.send(Msg::Release { handle });
                return match waiting {
                    None => Ok(()),
                    Some(_) => Err(Error::Protocol("control channel: a rails request answered with one key".into())),
                };
            };
            if remote.len != len {
                let _ = cs.out.send(Msg::Release { handle });
                return Err(Error::Protocol(format!("control channel: {len} bytes asked for, {} granted", remote.len)));
            }
            // If nobody waits any more (a cancelled request), the handle's drop gives it back.
            let _ = tx.send(Ok(RemoteMemory::new(remote, handle, access, cs.out.clone(), cs.held.clone())));
        }
        Msg::Refused { seq, code, limit } => match cs.requests.lock().remove(&seq) {
            Some((Reply::One(tx), _, _)) => drop(tx.send(Err((code, limit)))),
            Some((Reply::Rails(reply), _, requested)) => {
                reply(Err(Error::RemoteRefused { requested, reason: code, limit }))
            }
            None => {}
        },
        Msg::Release { handle } => drop(unlend(&cs.lending, sh, handle, true).await),
        Msg::HandOver { handle, tag } => {
            // A share of memory lent over rails is released: only all of a buffer is handed.
            if let Some(buf) = unlend(&cs.lending, sh, handle, true).await.and_then(Kept::into_own) {
                cs.lending.lock().handed(buf.len() as u64, true);
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
        Msg::RailsRequest { seq, len, access } => match cs.group().await {
            Some(g) => g.serve(seq, len, access_of(access), cs.clone()),
            None => drop(cs.out.send(Msg::Refused { seq, code: RemoteRefusal::NotServing, limit: 0 })),
        },
        Msg::RailsGranted { seq, addr, len: got, keys } => {
            let waiting = cs.requests.lock().remove(&seq);
            let group = cs.group().await;
            let Some(group) = group else {
                release_own(cs, sh, &keys);
                return Err(Error::Protocol("control channel: memory over rails granted to no rail group".into()));
            };
            match waiting {
                Some((Reply::Rails(reply), _, len)) if got == len => reply(Ok((addr, got, keys))),
                // Nobody asked (or the answer came after the peer was declared gone): give it back.
                None => group.give_back((addr, got, keys)),
                Some((_, _, len)) => {
                    group.give_back((addr, got, keys));
                    return Err(Error::Protocol(format!(
                        "control channel: {len} bytes asked for (or one key), {got} granted over rails"
                    )));
                }
            }
        }
        Msg::RailsPush { addr, len, access, tag, keys } => {
            let group = cs.group().await;
            let Some(group) = group else {
                release_own(cs, sh, &keys);
                return Err(Error::Protocol("control channel: memory over rails pushed to no rail group".into()));
            };
            group.pushed(tag, (addr, len, keys), access_of(access))?;
        }
        Msg::Ping | Msg::Bye => {}
    }
    Ok(())
}

/// Gives back the key of `keys` that is this connection's own (a rails message for a
/// connection that is no rail: the other keys' rails are unknown here, and their owner frees
/// them when those connections go).
fn release_own(cs: &ControlShared, sh: &Shared, keys: &RailKeys) {
    let peer = sh.conn().peer().gid;
    if let Some(k) = keys.as_slice().iter().find(|k| k.gid() == peer) {
        let _ = cs.out.send(Msg::Release { handle: k.handle() });
    }
}

/// The answer to a request for `len` bytes with `access`.
async fn serve(cs: &Arc<ControlShared>, sh: &Arc<Shared>, seq: u64, len: u64, access: Access) -> Msg {
    let refuse = |code, limit| Msg::Refused { seq, code, limit };
    let Some((heap, limits)) = cs.lending.lock().serving() else {
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
    match lend(&cs.lending, sh, Kept::Own(buf), access).await {
        Ok((handle, remote)) => {
            cs.lending.lock().announce(handle);
            Msg::Granted { seq, handle, remote }
        }
        Err(_) => refuse(RemoteRefusal::Unavailable, 0),
    }
}

pub(super) async fn send(
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
