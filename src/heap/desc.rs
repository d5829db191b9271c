//! A buffer's [`RemoteDesc`]: its key on every device its heap is bound to.

use crate::error::{Error, Result};
use crate::heap::buffer::Buffer;
use crate::remote_desc::{DeviceKey, RemoteDesc};
use crate::verbs::Access;

impl Buffer {
    /// [`Buffer::remote`] on every device the heap is bound to, in one descriptor: a
    /// registration of exactly the buffer per bound PD (made on first use, reused after; all
    /// removed by [`Buffer::revoke_remote`] or the buffer's drop), read-only, each key beside the
    /// GID of its device ([`crate::verbs::Context::default_gid`]; see [`RemoteDesc`] for why
    /// the GID).
    ///
    /// # Errors
    /// [`Error::NoRemoteAccess`] if the heap was built without [`Access::REMOTE_READ`],
    /// [`Error::NotRegistered`] if it is bound to no PD, [`Error::Verbs`] if a device refuses a
    /// registration or a GID query, [`Error::NoActiveDevice`] if a bound device has no active
    /// port, [`Error::InvalidArgument`] if two bound PDs are on the same device (their keys
    /// would share one identity: bind one PD per device), [`Error::Forked`]
    /// in a fork()ed child. Registrations made before an error stay until revoked.
    pub fn remote_desc(&self) -> Result<RemoteDesc> {
        self.check_readable()?;
        self.desc_with(Access::REMOTE_READ)
    }

    /// Keys with `rights` through every bound PD (the caller decides the rights are sound).
    pub(crate) fn desc_with(&self, rights: Access) -> Result<RemoteDesc> {
        let pds = self.bound_pds();
        if pds.is_empty() {
            return Err(Error::NotRegistered { addr: self.addr() });
        }
        let mut keys = Vec::with_capacity(pds.len());
        for pd in &pds {
            // The key first: it refuses a fork()ed child before any query of the parent's device.
            let remote = self.key_with(pd, rights)?;
            let gid = pd.context().default_gid()?;
            if keys.iter().any(|k: &DeviceKey| k.gid == gid) {
                return Err(Error::InvalidArgument(format!(
                    "the heap is bound to two protection domains of device {}: a RemoteDesc holds one key per \
                     device (the peer picks it by the device's GID, {gid}), so bind one PD per device \
                     (rails over one device may share its PD)",
                    pd.context().name()
                )));
            }
            keys.push(DeviceKey { gid, rkey: remote.rkey });
        }
        RemoteDesc::new(self.addr(), self.size() as u64, &keys)
    }
}
