//! The borrower's side of memory lent over a rail group: matching the keys to the rails,
//! requests, pushes taken, and the handle, [`RailsRemoteMemory`].

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::remote_desc::{DeviceKey, RemoteDesc};
use crate::transfer::front::aio::control::{RailsGrant, KEEPALIVE};
use crate::transfer::front::aio::lending::Held;
use crate::transfer::front::aio::rails_lending::RailsLending;
use crate::transfer::front::aio::wire::Msg;
use crate::transfer::front::aio::wire::RailKeys;
use crate::verbs::Access;

impl RailsLending {
    /// The borrower's handle on memory the peer lent over the group: each key matched to the
    /// rail whose connection it names (the peer end's GID and queue pair number). A key that
    /// names no rail (a connection since replaced, or one whose ends see other GIDs) is left
    /// out, and to its owner, who frees it when that connection goes: its handle means
    /// something only on its own connection.
    ///
    /// # Errors
    /// [`Error::Protocol`] if no key is for a rail of the group.
    pub(crate) fn held(&self, addr: u64, len: u64, access: Access, keys: &RailKeys) -> Result<RailsRemoteMemory> {
        // Under the lock: a restore does not replace a rail between its match and its count.
        let ends = self.ends.lock();
        let mut held = Vec::new();
        let mut found = Vec::new();
        for k in keys.as_slice() {
            let rail = ends.iter().enumerate().find_map(|(i, e)| {
                let sh = e.data.upgrade()?;
                let peer = sh.conn().peer();
                let out = sh.control.as_ref()?.sender();
                (peer.qpn == k.qpn() && peer.gid == k.gid()).then_some((i, out, e))
            });
            match rail {
                Some((rail, out, end)) => {
                    end.keys.fetch_add(1, Ordering::Relaxed);
                    held.push(HeldKey { rail, out, handle: k.handle(), count: end.keys.clone() });
                    found.push(DeviceKey { gid: k.gid(), rkey: k.rkey() });
                }
                None => {
                    tracing::debug!("remote memory over rails: a key for {} reaches no rail of this group", k.gid())
                }
            }
        }
        drop(ends);
        let desc = if found.is_empty() {
            Err(Error::Protocol("control channel: memory over rails with a key for no rail of this group".into()))
        } else {
            RemoteDesc::new(addr, len, &found)
        };
        match desc {
            Ok(desc) => Ok(RailsRemoteMemory::new(desc, access, held, self.held.clone())),
            Err(e) => {
                held.into_iter().for_each(HeldKey::give_back);
                Err(e)
            }
        }
    }

    /// The next memory the peer pushed over the group, with its tag.
    ///
    /// # Errors
    /// [`Error::RailsDown`] once no rail lives and nothing is queued.
    pub(crate) async fn pushed(&self) -> Result<(u64, RailsRemoteMemory)> {
        let mut rx = self.pushed_rx.lock().await;
        let timers = self.timers;
        loop {
            if let Ok(got) = rx.try_recv() {
                return Ok(got);
            }
            let (live, failures) = self.live();
            if live.is_empty() {
                return Err(Error::RailsDown { failures });
            }
            drop(live);
            if !timers {
                return rx.recv().await.ok_or(Error::Closed);
            }
            // Checked again at every keepalive: the rails may all die meanwhile.
            if let Ok(got) = tokio::time::timeout(KEEPALIVE, rx.recv()).await {
                return got.ok_or(Error::Closed);
            }
        }
    }

    /// Asks the peer for `len` bytes with `access` over the group, on the first live rail.
    pub(crate) fn request(
        self: &Arc<Self>,
        len: u64,
        access: Access,
    ) -> impl Future<Output = Result<RailsRemoteMemory>> + Send + 'static {
        let (tx, rx) = oneshot::channel();
        let group = self.clone();
        // Run by the request rail's control task: a handle nobody takes any more (a cancelled
        // request) is dropped, so given back.
        let reply = Box::new(move |answer: Result<RailsGrant>| {
            let _ = tx.send(answer.and_then(|(addr, len, keys)| group.held(addr, len, access, &keys)));
        });
        let started = self.messages().and_then(|l| {
            l.cs.request_rails(len, access, reply)?;
            Ok((l.sh.clone(), rx))
        });
        async move {
            let (sh, rx) = started?;
            match rx.await {
                Ok(answer) => answer,
                Err(_) => Err(sh.conn().error().unwrap_or(Error::Closed)),
            }
        }
    }
}

/// Memory of the peer's heap reachable through every rail of an
/// [`AsyncRails`](crate::transfer::AsyncRails) group, until the handle is dropped: requested
/// with [`AsyncRails::request_remote`](crate::transfer::AsyncRails::request_remote) or pushed
/// by the peer ([`AsyncRails::pushed`](crate::transfer::AsyncRails::pushed)). Its
/// [`RemoteDesc`] carries a key per rail (each working through that rail's connection only,
/// on exactly this memory): striped WRITEs and READs
/// ([`AsyncRails::write`](crate::transfer::AsyncRails::write)) use them all.
///
/// Dropping the handle tells the peer on every rail, which revokes each key and frees the
/// memory with the last. A rail that fails takes its key with it (the peer frees that key once
/// the rail's queue pair is flushed); the others keep working. While the handle lives, the
/// rails it has keys on are not [restored](crate::transfer::AsyncRails::restore): the peer's
/// new connection would be handed the old key.
pub struct RailsRemoteMemory {
    desc: RemoteDesc,
    access: Access,
    keys: Vec<HeldKey>,
    held: Arc<Held>,
}

/// One rail's key of a handle: where to give it back.
struct HeldKey {
    /// The rail's index in the group.
    rail: usize,
    /// The rail's control channel.
    out: UnboundedSender<Msg>,
    /// The key's name there.
    handle: u64,
    /// The rail's count of keys held (counted from [`RailsRemoteMemory::new`] to its drop).
    count: Arc<AtomicUsize>,
}

impl HeldKey {
    /// Tells the key's rail that it is given back, and stops counting it there. (A rail that is
    /// gone: the peer freed that key when it noticed.)
    fn give_back(self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
        let _ = self.out.send(Msg::Release { handle: self.handle });
    }
}

impl std::fmt::Debug for RailsRemoteMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailsRemoteMemory")
            .field("desc", &self.desc)
            .field("access", &self.access)
            .field("rails", &self.rails().collect::<Vec<_>>())
            .finish()
    }
}

impl RailsRemoteMemory {
    /// The handle of `desc` (whose keys are `keys`', in order), counted in `held` and in each
    /// key's rail count. The caller has counted each key in its rail already.
    fn new(desc: RemoteDesc, access: Access, keys: Vec<HeldKey>, held: Arc<Held>) -> RailsRemoteMemory {
        held.count(desc.len());
        RailsRemoteMemory { desc, access, keys, held }
    }

    /// Address, length and a key per rail, for the group's transfers.
    pub fn desc(&self) -> RemoteDesc {
        self.desc
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.desc.len()
    }

    /// Never true: remote memory is at least one byte.
    pub fn is_empty(&self) -> bool {
        self.desc.len() == 0
    }

    /// The rights granted (remote read and/or write).
    pub fn access(&self) -> Access {
        self.access
    }

    /// The rails (the group's indexes) the memory has a key on.
    pub fn rails(&self) -> impl Iterator<Item = usize> + '_ {
        self.keys.iter().map(|k| k.rail)
    }
}

impl Drop for RailsRemoteMemory {
    fn drop(&mut self) {
        self.keys.drain(..).for_each(HeldKey::give_back);
        self.held.uncount(self.desc.len());
    }
}
