//! The out-of-band connection message exchanged over TCP.
//!
//! ```text
//! "mRdx" | version u16 | kind u8 | reserved u8 | endpoint (32 bytes) | blob length u32 | blob
//! ```
//!
//! Every field is checked before anything is allocated: a wrong magic or version, a truncated
//! message or a blob longer than [`MAX_BLOB`] is a typed error, never a panic or an unbounded
//! allocation.

use std::io::{Read, Write};

use crate::error::{Error, Result};
use crate::verbs::Endpoint;

/// Magic bytes of a connection message.
pub const MAGIC: [u8; 4] = *b"mRdx";
/// Protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Largest application blob carried with an endpoint.
pub const MAX_BLOB: usize = 64 << 10;
const HEADER: usize = 4 + 2 + 1 + 1 + Endpoint::ENCODED_LEN + 4;

/// What a message announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client → server: my endpoint (+ blob).
    Hello = 1,
    /// Server → client: my endpoint (+ blob).
    Welcome = 2,
    /// Either side: my QP is ready to receive.
    Ready = 3,
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// What it announces.
    pub kind: Kind,
    /// The sender's QP endpoint.
    pub endpoint: Endpoint,
    /// Application data (e.g. an encoded [`crate::RemoteBuf`]).
    pub blob: Vec<u8>,
}

fn malformed(why: String) -> Error {
    Error::Protocol(why)
}

impl Message {
    /// Encodes the message.
    pub fn encode(&self) -> Result<Vec<u8>> {
        if self.blob.len() > MAX_BLOB {
            return Err(Error::InvalidArgument(format!(
                "connection blob of {} bytes exceeds the {MAX_BLOB}-byte limit",
                self.blob.len()
            )));
        }
        let mut b = Vec::with_capacity(HEADER + self.blob.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_be_bytes());
        b.push(self.kind as u8);
        b.push(0);
        b.extend_from_slice(&self.endpoint.to_bytes());
        b.extend_from_slice(&(self.blob.len() as u32).to_be_bytes());
        b.extend_from_slice(&self.blob);
        Ok(b)
    }

    /// Parses the fixed header; returns the message without its blob and the blob length.
    pub fn parse_header(h: &[u8]) -> Result<(Kind, Endpoint, usize)> {
        if h.len() < HEADER {
            return Err(malformed(format!("truncated header: {} of {HEADER} bytes", h.len())));
        }
        if h[..4] != MAGIC {
            return Err(malformed(format!("bad magic {:02x?} (not an mralloc peer?)", &h[..4])));
        }
        let version = u16::from_be_bytes([h[4], h[5]]);
        if version != VERSION {
            return Err(malformed(format!("peer speaks protocol version {version}, this build speaks {VERSION}")));
        }
        let kind = match h[6] {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Ready,
            k => return Err(malformed(format!("unknown message kind {k}"))),
        };
        let endpoint = Endpoint::from_bytes(&h[8..8 + Endpoint::ENCODED_LEN]).map_err(|e| malformed(e.to_string()))?;
        let at = 8 + Endpoint::ENCODED_LEN;
        let len = u32::from_be_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]) as usize;
        if len > MAX_BLOB {
            return Err(malformed(format!("blob length {len} exceeds the {MAX_BLOB}-byte limit")));
        }
        Ok((kind, endpoint, len))
    }

    /// Decodes a whole message from a byte slice (header and blob, nothing more).
    pub fn decode(b: &[u8]) -> Result<Message> {
        let (kind, endpoint, len) = Message::parse_header(b)?;
        let rest = &b[HEADER..];
        if rest.len() != len {
            return Err(malformed(format!("blob is {} bytes, header says {len}", rest.len())));
        }
        Ok(Message { kind, endpoint, blob: rest.to_vec() })
    }

    /// Writes the message to a stream.
    pub fn send(&self, w: &mut impl Write) -> Result<()> {
        let bytes = self.encode()?;
        w.write_all(&bytes).and_then(|_| w.flush()).map_err(|e| io("sending a connection message", e))
    }

    /// Reads one message from a stream (bounded by [`MAX_BLOB`]).
    pub fn recv(r: &mut impl Read) -> Result<Message> {
        let mut h = [0u8; HEADER];
        r.read_exact(&mut h).map_err(|e| io("reading a connection message", e))?;
        let (kind, endpoint, len) = Message::parse_header(&h)?;
        let mut blob = vec![0u8; len];
        r.read_exact(&mut blob).map_err(|e| io("reading a connection message's blob", e))?;
        Ok(Message { kind, endpoint, blob })
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    let what = match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!("{what}: timed out"),
        std::io::ErrorKind::UnexpectedEof => format!("{what}: the peer closed the connection"),
        _ => what.to_string(),
    };
    Error::Io { what, source: e }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{Gid, Mtu};
    use proptest::prelude::*;

    fn ep() -> Endpoint {
        Endpoint { qpn: 7, psn: 9, gid: Gid::from_bytes([1; 16]), lid: 0, mtu: Mtu::Mtu1024 }
    }

    #[test]
    fn round_trip() {
        let m = Message { kind: Kind::Hello, endpoint: ep(), blob: b"remote-buf".to_vec() };
        let b = m.encode().unwrap();
        assert_eq!(Message::decode(&b).unwrap(), m);
        assert_eq!(Message::recv(&mut &b[..]).unwrap(), m);
    }

    #[test]
    fn rejects_bad_input() {
        let good = Message { kind: Kind::Welcome, endpoint: ep(), blob: vec![] }.encode().unwrap();
        let mut b = good.clone();
        b[5] = 9;
        assert!(Message::decode(&b).unwrap_err().to_string().contains("version 9"));
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(Message::decode(&b), Err(Error::Protocol(_))));
        let mut b = good.clone();
        let at = 8 + Endpoint::ENCODED_LEN;
        b[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(Message::decode(&b).unwrap_err().to_string().contains("exceeds"));
        assert!(Message::recv(&mut &good[..10]).is_err());
        let big = Message { kind: Kind::Hello, endpoint: ep(), blob: vec![0; MAX_BLOB + 1] };
        assert!(big.encode().is_err());
    }

    proptest! {
        #[test]
        fn parser_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Message::decode(&bytes);
            let _ = Message::recv(&mut &bytes[..]);
        }

        #[test]
        fn parser_survives_corrupted_valid_messages(pos in 0usize..60, val in any::<u8>(), blob in proptest::collection::vec(any::<u8>(), 0..32)) {
            let mut b = Message { kind: Kind::Hello, endpoint: ep(), blob }.encode().unwrap();
            let i = pos % b.len();
            b[i] = val;
            if let Ok(m) = Message::decode(&b) {
                prop_assert!(m.blob.len() <= MAX_BLOB);
            }
        }
    }
}
