//! What one side of an RC connection tells the other: QP number, PSN, GID, LID, MTU.

use std::fmt;
use std::net::Ipv6Addr;

use rdma_sys as ffi;

use crate::error::{Error, Result};

/// A 128-bit global identifier (an IPv6 address on RoCE).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid([u8; 16]);

impl Gid {
    /// From the 16 raw bytes (network order).
    pub const fn from_bytes(raw: [u8; 16]) -> Gid {
        Gid(raw)
    }

    /// The 16 raw bytes (network order).
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// All zero: an unpopulated table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// `::ffff:a.b.c.d` — a RoCE v2 GID derived from an IPv4 address.
    pub fn is_ipv4_mapped(&self) -> bool {
        Ipv6Addr::from(self.0).to_ipv4_mapped().is_some()
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// Path MTU of an RC connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// From the `IBV_MTU_*` value.
    ///
    /// # Errors
    /// Returns `None` if `raw` is not an `IBV_MTU_*` value.
    pub fn from_raw(raw: ffi::ibv_mtu::Type) -> Option<Mtu> {
        Some(match raw {
            ffi::ibv_mtu::IBV_MTU_256 => Mtu::Mtu256,
            ffi::ibv_mtu::IBV_MTU_512 => Mtu::Mtu512,
            ffi::ibv_mtu::IBV_MTU_1024 => Mtu::Mtu1024,
            ffi::ibv_mtu::IBV_MTU_2048 => Mtu::Mtu2048,
            ffi::ibv_mtu::IBV_MTU_4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// The `IBV_MTU_*` value.
    pub fn to_raw(self) -> ffi::ibv_mtu::Type {
        match self {
            Mtu::Mtu256 => ffi::ibv_mtu::IBV_MTU_256,
            Mtu::Mtu512 => ffi::ibv_mtu::IBV_MTU_512,
            Mtu::Mtu1024 => ffi::ibv_mtu::IBV_MTU_1024,
            Mtu::Mtu2048 => ffi::ibv_mtu::IBV_MTU_2048,
            Mtu::Mtu4096 => ffi::ibv_mtu::IBV_MTU_4096,
        }
    }

    /// The size in bytes.
    pub fn bytes(self) -> u32 {
        128 << self.to_raw()
    }
}

/// The connection details of one RC queue pair, exchanged out of band (TCP, RDMA CM private
/// data, a file...) so that the peer can move its QP to RTR.
///
/// It encodes to a fixed 32-byte, versioned, big-endian message with [`Endpoint::to_bytes`];
/// [`Endpoint::from_bytes`] rejects anything else with a typed error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number the QP sends (24 bits).
    pub psn: u32,
    /// GID of the port (RoCE: required; IB: used when non-zero).
    pub gid: Gid,
    /// LID of the port (IB; 0 on RoCE).
    pub lid: u16,
    /// Active MTU of the port.
    pub mtu: Mtu,
}

const ENDPOINT_MAGIC: [u8; 2] = *b"mR";
const ENDPOINT_VERSION: u8 = 1;

impl Endpoint {
    /// Size of the encoded form.
    pub const ENCODED_LEN: usize = 32;

    /// Encodes as `"mR"`, version, MTU, QPN, PSN, LID, 2 reserved bytes, GID.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..2].copy_from_slice(&ENDPOINT_MAGIC);
        b[2] = ENDPOINT_VERSION;
        b[3] = self.mtu.to_raw() as u8;
        b[4..8].copy_from_slice(&self.qpn.to_be_bytes());
        b[8..12].copy_from_slice(&self.psn.to_be_bytes());
        b[12..14].copy_from_slice(&self.lid.to_be_bytes());
        b[16..32].copy_from_slice(self.gid.as_bytes());
        b
    }

    /// Decodes what [`Endpoint::to_bytes`] produced.
    ///
    /// # Errors
    /// [`Error::MalformedEndpoint`] if `b` is not 32 bytes long, or has the wrong magic or version,
    /// an unknown MTU code, a QPN or PSN above 24 bits, or non-zero reserved bytes.
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        let bad = |why: String| Err(Error::MalformedEndpoint(why));
        if b.len() != Self::ENCODED_LEN {
            return bad(format!("expected {} bytes, got {}", Self::ENCODED_LEN, b.len()));
        }
        if b[0..2] != ENDPOINT_MAGIC {
            return bad(format!("bad magic {:02x}{:02x}", b[0], b[1]));
        }
        if b[2] != ENDPOINT_VERSION {
            return bad(format!("unsupported version {} (this build speaks {ENDPOINT_VERSION})", b[2]));
        }
        let Some(mtu) = Mtu::from_raw(b[3].into()) else {
            return bad(format!("bad MTU code {}", b[3]));
        };
        let word = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (qpn, psn) = (word(4), word(8));
        if qpn > 0xff_ffff || psn > 0xff_ffff {
            return bad(format!("QPN {qpn:#x} or PSN {psn:#x} exceeds 24 bits"));
        }
        // One spelling per endpoint: the reserved bytes are written as zeros and read as such.
        if b[14..16] != [0, 0] {
            return bad(format!("reserved bytes {:02x}{:02x} are not zero", b[14], b[15]));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        Ok(Endpoint { qpn, psn, lid: u16::from_be_bytes([b[12], b[13]]), mtu, gid: Gid::from_bytes(gid) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Endpoint {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 77, 0, 1]);
        Endpoint { qpn: 0x11, psn: 0xabcdef, gid: Gid::from_bytes(g), lid: 7, mtu: Mtu::Mtu1024 }
    }

    #[test]
    fn endpoint_round_trip() {
        let e = sample();
        assert_eq!(Endpoint::from_bytes(&e.to_bytes()).unwrap(), e);
        assert_eq!(e.gid.to_string(), "::ffff:10.77.0.1");
        assert!(e.gid.is_ipv4_mapped());
    }

    #[test]
    fn endpoint_rejects_malformed() {
        let good = sample().to_bytes();
        assert!(matches!(Endpoint::from_bytes(&good[..31]), Err(Error::MalformedEndpoint(_))));
        let mut b = good;
        b[2] = 9;
        let err = Endpoint::from_bytes(&b).unwrap_err().to_string();
        assert!(err.contains("unsupported version 9"), "{err}");
        let mut b = good;
        b[3] = 0;
        assert!(Endpoint::from_bytes(&b).is_err());
        let mut b = good;
        b[4] = 1; // QPN above 24 bits
        assert!(Endpoint::from_bytes(&b).is_err());
        let mut b = good;
        b[0] = b'x';
        assert!(Endpoint::from_bytes(&b).is_err());
    }

    #[test]
    fn mtu_bytes() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        for m in [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu1024, Mtu::Mtu2048, Mtu::Mtu4096] {
            assert_eq!(Mtu::from_raw(m.to_raw()), Some(m));
        }
    }
}
