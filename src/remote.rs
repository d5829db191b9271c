//! `RemoteBuf`: what a peer needs to address a buffer of ours.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::verbs::RemoteAddr;

/// A remote buffer: address, length and rkey, as handed to a peer. Small, `Copy`, and encoded
/// to 20 bytes with [`RemoteBuf::to_bytes`] for any out-of-band channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteBuf {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key granting access.
    pub rkey: u32,
}

impl RemoteBuf {
    /// Encoded size.
    pub const ENCODED_LEN: usize = 20;

    /// Big-endian `addr`, `len`, `rkey`.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Decodes [`RemoteBuf::to_bytes`]; rejects other lengths and ranges that wrap around.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteBuf> {
        let b: &[u8; Self::ENCODED_LEN] = b.try_into().map_err(|_| {
            Error::InvalidArgument(format!("a RemoteBuf is {} bytes, got {}", Self::ENCODED_LEN, b.len()))
        })?;
        let r = RemoteBuf {
            addr: u64::from_be_bytes(b[..8].try_into().expect("8 bytes")),
            len: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
            rkey: u32::from_be_bytes(b[16..].try_into().expect("4 bytes")),
        };
        r.addr.checked_add(r.len).ok_or_else(|| Error::InvalidArgument(format!("remote range {r:?} wraps around")))?;
        Ok(r)
    }

    /// The sub-range `range` (offsets into this buffer), bounds-checked.
    pub fn slice(&self, range: Range<u64>) -> Result<RemoteBuf> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::OutOfBounds {
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                size: self.len,
            });
        }
        Ok(RemoteBuf { addr: self.addr + range.start, len: range.end - range.start, rkey: self.rkey })
    }

    /// The address of `offset` (bounds-checked against `len` bytes following it).
    pub fn at(&self, offset: u64, len: u64) -> Result<RemoteAddr> {
        let end = offset.checked_add(len);
        // Also refuse a range that wraps the address space (the fields are public: a RemoteBuf
        // need not come from from_bytes, which checks this too).
        if end.is_none_or(|e| e > self.len || self.addr.checked_add(e).is_none()) {
            return Err(Error::OutOfBounds { offset, len, size: self.len });
        }
        Ok(RemoteAddr { addr: self.addr + offset, rkey: self.rkey })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bounds() {
        let r = RemoteBuf { addr: 0x7f00_0000_1000, len: 4096, rkey: 0xabc };
        assert_eq!(RemoteBuf::from_bytes(&r.to_bytes()).unwrap(), r);
        assert!(RemoteBuf::from_bytes(&r.to_bytes()[..19]).is_err());
        let wrap = RemoteBuf { addr: u64::MAX - 1, len: 10, rkey: 1 };
        assert!(RemoteBuf::from_bytes(&wrap.to_bytes()).is_err());
        assert_eq!(r.slice(100..200).unwrap(), RemoteBuf { addr: r.addr + 100, len: 100, rkey: 0xabc });
        assert!(matches!(r.slice(100..5000), Err(Error::OutOfBounds { .. })));
        assert!(r.at(4095, 1).is_ok());
        assert!(r.at(4095, 2).is_err());
        assert!(r.at(u64::MAX, 2).is_err());
        let wrapping = RemoteBuf { addr: u64::MAX - 10, len: 4096, rkey: 1 };
        assert!(wrapping.at(0, 4096).is_err(), "a range that wraps the address space");
    }
}
