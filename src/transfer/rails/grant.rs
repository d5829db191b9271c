//! Grants over rails: one owned buffer, a key per rail, one descriptor for the peer.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::Error;
use crate::remote_desc::{DeviceKey, RemoteDesc};
use crate::transfer::exact::Keyed;
use crate::transfer::grant::{bind, release, revoke, BindFailed, Bound};
use crate::transfer::rails::{Rail, Rails};
use crate::transfer::request::iobuf::{IoBufMut, Rejected};
#[cfg(doc)]
use crate::transfer::{Connection, Grant};
use crate::verbs::Access;

/// What every key of a rails grant holds a share of: the buffer, freed when the last key is
/// released. (The mutex only makes the share `Send` for any `Send` buffer: nobody locks it
/// until the last share is unwrapped.)
type Share<B> = Arc<Mutex<B>>;

/// Remote access to one buffer, given to the peer of a [`Rails`] group through every live rail
/// at once: a [`Grant`] per rail (a memory window bound through that rail's connection, over
/// exactly the buffer's bytes), gathered in one [`RemoteDesc`] — the key of each rail under
/// the GID this side's end of that rail presents, which is what the peer's
/// [`RemoteDesc::for_peer`] matches. The peer's own [`Rails`] stripe over it as over any
/// descriptor; a rail that fails takes its key with it, and the others keep working.
///
/// The keys work through the grant's connections only (type 2 windows): the descriptor is for
/// the peer's ends of this group, not for other connections to the same devices, and a rail
/// is not [restored](Rails::restore) while a grant has a key on it.
///
/// The grant owns the buffer, as a [`Grant`] does:
/// - [`RailsGrant::revoke`] kills every key, waits for that, and gives the buffer back;
/// - dropping it kills every key without waiting: the buffer is freed once every rail has
///   reaped its key's invalidation (a failed rail: once its queue pair is flushed, when its
///   connection is dropped);
/// - forgetting it leaks the buffer, and keeps the rails' connections open (the grant holds
///   them, so that no queue pair goes while a window is bound through it).
///
/// As for [`Connection::grant`]: the buffer must come from a heap built with
/// [`Access::MW_BIND`] (not part of [`Access::ALL_REMOTE`]; the key carries the remote rights,
/// the heap's chunks need none) and bound to every rail's protection domain; the rails' queue
/// pairs must admit what the grant allows
/// ([`QpOptions::remote_access`](crate::transfer::QpOptions::remote_access) on this side: the
/// peer's request is refused with [`Error::NotGranted`] otherwise).
///
/// ```no_run
/// use mralloc::transfer::{Options, QpOptions, RailOptions, RailsListener};
/// use mralloc::verbs::{Access, Context, Pd};
/// use mralloc::Heap;
///
/// let pds = ["mlx5_0", "mlx5_1"].map(|d| Pd::new(&Context::open(d)?)).into_iter().collect::<mralloc::Result<Vec<_>>>()?;
/// // Grants need MW_BIND on the heap; the key carries the remote rights.
/// let heap = pds.iter().fold(Heap::builder(), |b, pd| b.bind(pd)).access(Access::MW_BIND).build()?;
/// // This side's queue pairs admit the peer's WRITEs.
/// let qp = QpOptions { remote_access: Access::REMOTE_WRITE, ..QpOptions::default() };
/// let opts = RailOptions { conn: Options { qp, ..Options::default() }, ..RailOptions::default() };
/// let rails = RailsListener::bind("0.0.0.0:7471", &pds, opts)?.accept()?;
/// let grant = rails.grant(heap.alloc(1 << 20)?, Access::REMOTE_WRITE)?;
/// // The descriptor goes to the peer as a message, from registered memory (the peer receives
/// // it into RemoteDesc::MAX_ENCODED_LEN bytes and decodes it with RemoteDesc::from_bytes).
/// let mut msg = heap.alloc(grant.desc().encoded_len())?;
/// msg.copy_from_slice(&grant.desc().to_vec());
/// rails.send(&msg)?;
/// // The peer stripes its WRITEs over the rails, then says it is done (after its transfer
/// // completed: the bytes are in place by then).
/// rails.recv(&mut heap.alloc(1)?)?;
/// let inbox = grant.revoke()?; // every key dead, the buffer back
/// # drop(inbox); Ok::<(), mralloc::Error>(())
/// ```
pub struct RailsGrant<B: IoBufMut> {
    /// A key per rail that took one, in rail order.
    keys: Vec<RailKey<B>>,
    desc: RemoteDesc,
}

/// One rail's key of a rails grant. The key is taken out to be revoked or released; one
/// dropped with the key still in (unwinding from a panic) leaks it, and so the buffer: its
/// window may still be bound (see [`Bound`]).
struct RailKey<B> {
    /// Its index in the group.
    at: usize,
    rail: Arc<Rail>,
    keyed: Bound<Share<B>>,
    /// As the descriptor names it.
    key: DeviceKey,
}

impl<B> RailKey<B> {
    /// The key, to revoke or release through `self.rail`: the rail counts it gone.
    fn take(&mut self) -> Keyed<Share<B>> {
        self.rail.count_grant_key(false);
        self.keyed.take()
    }
}

impl<B: IoBufMut> std::fmt::Debug for RailsGrant<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailsGrant")
            .field("desc", &self.desc)
            .field("rails", &self.rails().collect::<Vec<_>>())
            .finish()
    }
}

impl<B: IoBufMut> RailsGrant<B> {
    /// What the peer needs: address, length and a key per rail (encode it with
    /// [`RemoteDesc::to_vec`]).
    pub fn desc(&self) -> RemoteDesc {
        self.desc
    }

    /// The rails that carry a key (the group's indexes; those dead when the grant was made
    /// have none).
    pub fn rails(&self) -> impl Iterator<Item = usize> + '_ {
        self.keys.iter().map(|k| k.at)
    }

    /// Kills every rail's key (later remote accesses through any rail fail with a remote access
    /// error), waits for that, and returns the buffer. A key on a rail that failed meanwhile is
    /// dead once that rail's queue pair is flushed (its connection is closed for that).
    ///
    /// # Errors
    /// As [`Grant::revoke`], for the first rail whose key could not be shown dead — its
    /// invalidation failed and its connection did not flush (or the flush was lost) — with
    /// `buf` `None`: that rail's connection keeps the buffer until it is dropped (which the
    /// grant's rails are once this returns and the [`Rails`] is dropped); the other rails'
    /// keys are killed all the same. In a fork()ed child: [`Error::Forked`], with the child's
    /// copy of the buffer.
    pub fn revoke(mut self) -> std::result::Result<B, Rejected<B>> {
        match revoke_all(std::mem::take(&mut self.keys), None, None) {
            (Some(buf), None) => Ok(buf),
            (buf, error) => {
                let error = error.unwrap_or_else(|| Error::Protocol("a rails grant's buffer did not come back".into()));
                Err(Rejected { error, buf })
            }
        }
    }
}

impl<B: IoBufMut> Drop for RailsGrant<B> {
    fn drop(&mut self) {
        for mut k in std::mem::take(&mut self.keys) {
            let keyed = k.take();
            release(k.rail.conn(), keyed);
        }
    }
}

/// Revokes every key, waiting for each; the buffer back if every share came home (`home` is
/// one the caller still held), and the first error (`first`, then the revocations': a key
/// whose rail failed but whose share came back, its queue pair flushed, is dead, not an error).
fn revoke_all<B: IoBufMut>(
    keys: Vec<RailKey<B>>,
    mut home: Option<Share<B>>,
    mut first: Option<Error>,
) -> (Option<B>, Option<Error>) {
    for mut k in keys {
        let keyed = k.take();
        match revoke(k.rail.conn(), keyed) {
            Ok(share) => home = Some(share),
            Err(Rejected { error: e @ Error::Forked(_), buf }) => {
                first.get_or_insert(e);
                home = buf.or(home);
            }
            Err(Rejected { error, buf: Some(share) }) => {
                tracing::debug!("rail {}'s grant key died with its connection: {error}", k.at);
                home = Some(share);
            }
            Err(Rejected { error, buf: None }) => {
                first.get_or_insert(error);
            }
        }
    }
    // Every other share is dropped by now; one still held by a connection (a revocation that
    // could not be shown done) or leaked keeps the buffer from coming back.
    (home.and_then(|share| Arc::try_unwrap(share).ok()).map(Mutex::into_inner), first)
}

impl Rails {
    /// Grants the peer `access` (remote read and/or write) to exactly `buf` through every live
    /// rail: a window per rail bound through its connection, one [`RemoteDesc`] for all of
    /// them (see [`RailsGrant`]). Rails dead when it is called, or failing under the bind, get
    /// no key; the peer's transfers over the descriptor go on the others. The first grant on a
    /// device probes it (milliseconds, once per opened device).
    ///
    /// # Errors
    /// With the buffer back in [`Rejected`] (every key made so far is revoked first: if one
    /// cannot be, as [`RailsGrant::revoke`]):
    /// - [`Error::RailsDown`]: no rail lives (or every one failed while its key was bound);
    /// - [`Error::InvalidArgument`]: more live rails than a descriptor carries keys
    ///   ([`RemoteDesc::MAX_DEVICES`]), two rails whose ends present one GID (their keys could
    ///   not be told apart), or as [`Connection::grant`] (an empty buffer, other rights, a heap
    ///   without [`Access::MW_BIND`]);
    /// - as [`Connection::grant`] on a live rail: [`Error::NotRegistered`] (the buffer is not
    ///   in a heap bound to that rail's protection domain), [`Error::Verbs`], [`Error::Timeout`],
    ///   a bind the device refused ([`Error::Operation`]);
    /// - [`Error::FlushLost`] (a bind's flush never came): the buffer is leaked.
    pub fn grant<B: IoBufMut>(&self, mut buf: B, access: Access) -> std::result::Result<RailsGrant<B>, Rejected<B>> {
        let (ptr, len) = (buf.stable_mut_ptr(), buf.bytes_len());
        let (mut live, mut down) = (Vec::new(), Vec::new());
        for (i, rail) in self.group().rails().iter().enumerate() {
            match rail.conn().error() {
                None => live.push((i, rail)),
                Some(e) => down.push(format!("rail {i}: {e}")),
            }
        }
        if live.len() > RemoteDesc::MAX_DEVICES {
            let n = live.len();
            let why = format!("a descriptor carries {} keys, the group has {n} live rails", RemoteDesc::MAX_DEVICES);
            return Err(Rejected { error: Error::InvalidArgument(why), buf: Some(buf) });
        }
        let share: Share<B> = Arc::new(Mutex::new(buf));
        let mut keys: Vec<RailKey<B>> = Vec::with_capacity(live.len());
        let mut failed = None;
        for (i, rail) in live {
            let conn = rail.conn();
            // The GID the peer's end addresses this one by (an RDMA CM connection's from its route).
            let gid = match conn.qp().local_gid() {
                Ok(gid) => gid,
                Err(error) => {
                    failed = Some(error);
                    break;
                }
            };
            if let Some(j) = keys.iter().find(|k| k.key.gid == gid).map(|k| k.at) {
                let why = format!("rails {j} and {i} present one GID ({gid}): a grant needs a device per rail");
                failed = Some(Error::InvalidArgument(why));
                break;
            }
            // SAFETY: `share` owns `[ptr, ptr + len)` (a stable IoBufMut) and every key holds a
            // share of it, so it is freed only when the last key is released (each once dead)
            // or never; nothing references its bytes meanwhile: the grant gives no access to
            // them, and the buffer is unwrapped only once every share came back.
            let made = match unsafe { Keyed::prepare_over(conn, ptr, len, Arc::clone(&share), access) } {
                Ok((keyed, op)) => bind(conn, keyed, op),
                // Refused before anything was posted: the rail's failure (it died meanwhile), or
                // the buffer's or the rights' (its own).
                Err(rejected) => {
                    let own = rail.alive()
                        || matches!(rejected.error, Error::NotRegistered { .. } | Error::InvalidArgument(_));
                    Err(BindFailed { rejected, own })
                }
            };
            match made {
                Ok(keyed) => {
                    let key = DeviceKey { gid, rkey: keyed.remote().rkey };
                    rail.count_grant_key(true);
                    keys.push(RailKey { at: i, rail: Arc::clone(rail), keyed: Bound::new(keyed), key });
                }
                // The rail failed under the bind (by something else), and the share is back (the
                // window unbound or its queue pair flushed): the peer cannot use that rail either.
                Err(BindFailed { rejected: Rejected { error, buf: Some(_) }, own: false }) if !rail.alive() => {
                    down.push(format!("rail {i}: {error}"));
                }
                Err(BindFailed { rejected: Rejected { error, .. }, .. }) => {
                    failed = Some(error);
                    break;
                }
            }
        }
        let device_keys: Vec<DeviceKey> = keys.iter().map(|k| k.key).collect();
        let failed =
            failed.or_else(|| keys.is_empty().then(|| Error::RailsDown { failures: std::mem::take(&mut down) }));
        let made = match failed {
            None => RemoteDesc::new(ptr as u64, len as u64, &device_keys),
            Some(e) => Err(e),
        };
        match made {
            Ok(desc) => Ok(RailsGrant { keys, desc }),
            Err(error) => {
                // Nothing was handed out: every key is taken back before the buffer.
                let (buf, error) = revoke_all(keys, Some(share), Some(error));
                Err(Rejected { error: error.unwrap_or(Error::Closed), buf })
            }
        }
    }
}
