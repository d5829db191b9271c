//! The borrower's handle on memory lent over a rail group: [`RailsRemoteMemory`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use crate::remote_desc::RemoteDesc;
use crate::transfer::front::aio::lending::Held;
use crate::transfer::front::aio::wire::Msg;
use crate::verbs::Access;

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
pub(crate) struct HeldKey {
    /// The rail's index in the group.
    pub(crate) rail: usize,
    /// The rail's control channel.
    pub(crate) out: UnboundedSender<Msg>,
    /// The key's name there.
    pub(crate) handle: u64,
    /// The rail's count of keys held (counted from [`RailsRemoteMemory::new`] to its drop).
    pub(crate) count: Arc<AtomicUsize>,
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
    pub(crate) fn new(desc: RemoteDesc, access: Access, keys: Vec<HeldKey>, held: Arc<Held>) -> RailsRemoteMemory {
        held.buffers.fetch_add(1, Ordering::Relaxed);
        held.bytes.fetch_add(desc.len(), Ordering::Relaxed);
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
        for k in self.keys.drain(..) {
            k.count.fetch_sub(1, Ordering::Relaxed);
            // A rail that is gone: the peer freed that key when it noticed.
            let _ = k.out.send(Msg::Release { handle: k.handle });
        }
        self.held.buffers.fetch_sub(1, Ordering::Relaxed);
        self.held.bytes.fetch_sub(self.desc.len(), Ordering::Relaxed);
    }
}
