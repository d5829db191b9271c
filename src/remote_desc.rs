//! `RemoteDesc`: one buffer of ours as a peer reaches it through any of our devices.

use std::ops::Range;

use crate::error::{DescFault, Error, Result};
use crate::remote::RemoteBuf;
use crate::verbs::{Endpoint, Gid};

/// One device's key in a [`RemoteDesc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DeviceKey {
    /// The device's identity: the GID the exposing side's connections on it present.
    pub gid: Gid,
    /// The rkey of the buffer's registration with that device.
    pub rkey: u32,
}

/// A remote buffer reachable through several devices: address, length, and one rkey per device
/// of the exposing side (at most [`RemoteDesc::MAX_DEVICES`], each GID once). `Copy`; encoded
/// with [`RemoteDesc::to_bytes`].
///
/// A [`RemoteBuf`] names a buffer through one device: its rkey is meaningful only to the device
/// (the protection domain) that issued it — the same number on another device names some other
/// registration, or none. A buffer of a heap bound to several devices has a key per device; a
/// `RemoteDesc` carries them all, each beside the identity of the device it belongs to, so a
/// peer connected to us over several links (rails) picks, per connection, the key of the device
/// at the far end of that connection.
///
/// **The device identity is a GID**: the one the exposing side's queue pairs on that device
/// present in the connection handshake — what the peer's own queue pair then addresses every
/// packet to ([`crate::verbs::Endpoint::gid`], `Connection::peer().gid`). The exposing side writes
/// it from its own device (the default GID index of the device's first active port, the one a
/// `Connection` with default [`crate::transfer::DeviceChoice`] uses), and the peer reads it from
/// the connection it is about to use: both values come from the exposing side, and the one the
/// peer matches is the address its packets actually go to, so a key is only ever used toward the
/// device that announced it. (A node GUID would name the device too, but nothing ties it to the
/// link a connection runs over; a GID is per port and address, and a device has one per link.)
/// A connection set up with another GID index does not match: [`RemoteDesc::for_peer`] says so
/// ([`Error::NoKeyForDevice`]) rather than guess.
///
/// Wire format, version 1, big-endian:
///
/// ```text
/// version u8 = 1 | count u8 (1..=4) | addr u64 | len u64 | count x (gid [16] | rkey u32)
/// ```
///
/// [`RemoteDesc::from_bytes`] rejects anything else with [`Error::MalformedDescriptor`]: another
/// version, a count of 0 or over [`RemoteDesc::MAX_DEVICES`], fewer or more bytes than the count
/// calls for, a repeated or all-zero GID, a range that wraps around. It never panics and never
/// allocates.
///
/// Made by [`crate::heap::Exposed::desc`] and [`crate::Buffer::remote_desc`] from any bound
/// heap (one key per bound PD: one key for a heap bound to one device), and by grants and lent
/// memory over a rail group (a key per rail: `transfer::RailsGrant::desc`,
/// `transfer::RailsRemoteMemory::desc`); used through [`RemoteDesc::for_peer`] (or
/// `Connection::remote_of`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteDesc {
    addr: u64,
    len: u64,
    count: u8,
    keys: [DeviceKey; RemoteDesc::MAX_DEVICES],
}

impl std::fmt::Debug for RemoteDesc {
    /// The keys in use only (the unused slots are not keys).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDesc")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("keys", &self.keys())
            .finish()
    }
}

const HEADER: usize = 2 + 8 + 8;
const ENTRY: usize = 16 + 4;

impl RemoteDesc {
    /// The format version [`RemoteDesc::to_bytes`] writes and [`RemoteDesc::from_bytes`] reads.
    pub const VERSION: u8 = 1;
    /// Most device keys a descriptor carries (a heap binds at most this many PDs).
    pub const MAX_DEVICES: usize = 4;
    /// Largest encoded size: 98 bytes (four keys). [`RemoteDesc::to_vec`] is the simple way to
    /// encode; [`RemoteDesc::to_bytes`] needs no allocation.
    pub const MAX_ENCODED_LEN: usize = HEADER + Self::MAX_DEVICES * ENTRY;

    /// A descriptor of `[addr, addr+len)` with `keys`.
    ///
    /// # Errors
    /// [`Error::MalformedDescriptor`]: no key ([`DescFault::NoKeys`]), more than
    /// [`RemoteDesc::MAX_DEVICES`] ([`DescFault::TooMany`]), a GID twice
    /// ([`DescFault::DuplicateDevice`]) or all zero ([`DescFault::ZeroGid`]), a range that wraps
    /// ([`DescFault::Wraps`]).
    pub fn new(addr: u64, len: u64, keys: &[DeviceKey]) -> Result<RemoteDesc> {
        let bad = |f| Err(Error::MalformedDescriptor(f));
        if keys.is_empty() {
            return bad(DescFault::NoKeys);
        }
        if keys.len() > Self::MAX_DEVICES {
            return bad(DescFault::TooMany(keys.len()));
        }
        if addr.checked_add(len).is_none() {
            return bad(DescFault::Wraps { addr, len });
        }
        for (i, k) in keys.iter().enumerate() {
            if k.gid.is_zero() {
                return bad(DescFault::ZeroGid);
            }
            if keys[..i].iter().any(|o| o.gid == k.gid) {
                return bad(DescFault::DuplicateDevice(k.gid));
            }
        }
        let mut d = RemoteDesc { addr, len, count: keys.len() as u8, keys: [DeviceKey::default(); Self::MAX_DEVICES] };
        d.keys[..keys.len()].copy_from_slice(keys);
        Ok(d)
    }

    /// Start address in the owner's address space.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device keys, in the order they were made.
    pub fn keys(&self) -> &[DeviceKey] {
        &self.keys[..usize::from(self.count)]
    }

    /// The buffer as reached through the device at `gid`, if the descriptor has its key.
    pub fn for_gid(&self, gid: &Gid) -> Option<RemoteBuf> {
        self.keys().iter().find(|k| k.gid == *gid).map(|k| RemoteBuf { addr: self.addr, len: self.len, rkey: k.rkey })
    }

    /// The buffer as reached over a connection whose far end is `peer` (`Connection::peer()`):
    /// the key of the device at the peer's GID.
    ///
    /// # Errors
    /// [`Error::NoKeyForDevice`] if the descriptor has no key for that GID (another host's
    /// descriptor, or a connection set up with another GID index than the descriptor's).
    pub fn for_peer(&self, peer: &Endpoint) -> Result<RemoteBuf> {
        self.for_gid(&peer.gid).ok_or_else(|| Error::NoKeyForDevice {
            gid: peer.gid,
            have: self.keys().iter().map(|k| k.gid.to_string()).collect(),
        })
    }

    /// The sub-range `range` (offsets into this buffer), bounds-checked, with every key.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if `range` is reversed or runs past the end.
    pub fn slice(&self, range: Range<u64>) -> Result<RemoteDesc> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::OutOfBounds {
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                size: self.len,
            });
        }
        Ok(RemoteDesc { addr: self.addr + range.start, len: range.end - range.start, ..*self })
    }

    /// The encoded size of this descriptor.
    pub fn encoded_len(&self) -> usize {
        HEADER + usize::from(self.count) * ENTRY
    }

    /// Encodes in the format [`RemoteDesc`] describes: `buf[..n]` of the returned `(buf, n)`.
    pub fn to_bytes(&self) -> ([u8; Self::MAX_ENCODED_LEN], usize) {
        let mut b = [0u8; Self::MAX_ENCODED_LEN];
        b[0] = Self::VERSION;
        b[1] = self.count;
        b[2..10].copy_from_slice(&self.addr.to_be_bytes());
        b[10..18].copy_from_slice(&self.len.to_be_bytes());
        for (i, k) in self.keys().iter().enumerate() {
            let at = HEADER + i * ENTRY;
            b[at..at + 16].copy_from_slice(k.gid.as_bytes());
            b[at + 16..at + ENTRY].copy_from_slice(&k.rkey.to_be_bytes());
        }
        (b, self.encoded_len())
    }

    /// The encoding as a `Vec` (what [`RemoteDesc::to_bytes`] gives, trimmed).
    pub fn to_vec(&self) -> Vec<u8> {
        let (b, n) = self.to_bytes();
        b[..n].to_vec()
    }

    /// Decodes [`RemoteDesc::to_bytes`].
    ///
    /// # Errors
    /// [`Error::MalformedDescriptor`] with [`DescFault::Truncated`] (fewer bytes than the header
    /// or the entries it announces), [`DescFault::Version`], [`DescFault::Trailing`], or any fault
    /// [`RemoteDesc::new`] rejects.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteDesc> {
        let bad = |f| Err(Error::MalformedDescriptor(f));
        let Some(&version) = b.first() else {
            return bad(DescFault::Truncated { got: 0, need: HEADER });
        };
        if version != Self::VERSION {
            return bad(DescFault::Version(version));
        }
        if b.len() < HEADER {
            return bad(DescFault::Truncated { got: b.len(), need: HEADER });
        }
        let count = usize::from(b[1]);
        if count == 0 {
            return bad(DescFault::NoKeys);
        }
        if count > Self::MAX_DEVICES {
            return bad(DescFault::TooMany(count));
        }
        let need = HEADER + count * ENTRY;
        if b.len() < need {
            return bad(DescFault::Truncated { got: b.len(), need });
        }
        if b.len() > need {
            return bad(DescFault::Trailing(b.len() - need));
        }
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(w)
        };
        let mut keys = [DeviceKey::default(); Self::MAX_DEVICES];
        for (i, k) in keys.iter_mut().take(count).enumerate() {
            let at = HEADER + i * ENTRY;
            let mut gid = [0u8; 16];
            gid.copy_from_slice(&b[at..at + 16]);
            let mut rkey = [0u8; 4];
            rkey.copy_from_slice(&b[at + 16..at + ENTRY]);
            *k = DeviceKey { gid: Gid::from_bytes(gid), rkey: u32::from_be_bytes(rkey) };
        }
        RemoteDesc::new(u64_at(2), u64_at(10), &keys[..count])
    }
}

#[cfg(test)]
#[path = "remote_desc_tests.rs"]
mod tests;
