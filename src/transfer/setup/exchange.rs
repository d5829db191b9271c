//! The out-of-band connection message exchanged over TCP (protocol version 5).
//!
//! ```text
//! "mRdx" | version u16 | kind u8 | code u8 | rights u8 | endpoint (32 bytes)
//!        | control endpoint (32) | nonce (32) | mac (32) | blob length u32 | blob
//! ```
//!
//! A field a kind does not use is all zero (an absent endpoint is 32 zero bytes). Only `Hello`
//! and `Welcome` carry an endpoint (they must), a control endpoint (they may: the queue pair of
//! the connection's control channel, which async connections use for remote memory), the
//! rights the sender's queue pair grants the receiver ([`encode_rights`]: bit 0 RDMA WRITE, bit
//! 1 READ, bit 2 atomics; no other bit) and a blob; only `Refused` has a non-zero code. The
//! rights are the peer's word: they only ever make the receiver refuse a request earlier.
//! Every field is checked before anything is allocated: a wrong magic or version, an unknown
//! kind or code, a truncated message or a blob longer than [`MAX_BLOB`] is a typed error, never a
//! panic or an unbounded allocation.
//!
//! Without a shared secret: `Hello` (client) → `Welcome` (server) → `Ready` ↔ `Ready`. With one
//! (see [`crate::transfer::Secret`]) the client first sends a `Challenge` (its nonce), the server
//! answers with `Proof` (its nonce and a MAC over both), and `Hello` / `Welcome` carry MACs over
//! both nonces and the sender's endpoint and blob. A side that gives up sends `Refused`.
//!
//! After `Ready` nothing more is sent, but both sides keep the TCP connection open for the RDMA
//! connection's whole life: its closing (or reset) tells the other side that this one dropped
//! the connection or exited, and fails the connection there with
//! [`crate::Error::Disconnected`].

#[cfg(test)]
use std::io::{Read, Write};

use crate::error::{AuthFailure, Error, Result};
#[cfg(test)]
use crate::transfer::setup::wire::Plain;
use crate::transfer::setup::wire::{self, Wire};
use crate::verbs::{Access, Endpoint};

/// Magic bytes of a connection message.
pub const MAGIC: [u8; 4] = *b"mRdx";
/// Protocol version this build speaks (2: nonces, MACs and the authentication kinds; 3: the
/// control endpoint; 4: the rights byte; 5: control channels speak control version 2).
pub const VERSION: u16 = 5;
/// Largest application blob a TCP setup carries with an endpoint (`Listener::accept_with`,
/// `Connection::connect_with`).
pub const MAX_BLOB: usize = 64 << 10;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a MAC (HMAC-SHA-256).
pub const MAC_LEN: usize = 32;
/// Bytes before the blob.
pub const HEADER: usize = 4 + 2 + 1 + 1 + 1 + 2 * Endpoint::ENCODED_LEN + NONCE_LEN + MAC_LEN + 4;
const AT_RIGHTS: usize = 8;
const AT_ENDPOINT: usize = AT_RIGHTS + 1;
const AT_CONTROL: usize = AT_ENDPOINT + Endpoint::ENCODED_LEN;
const AT_NONCE: usize = AT_CONTROL + Endpoint::ENCODED_LEN;
const AT_MAC: usize = AT_NONCE + NONCE_LEN;
const AT_LEN: usize = AT_MAC + MAC_LEN;

/// What a message announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client → server: my endpoint (+ blob, + MAC with a secret).
    Hello = 1,
    /// Server → client: my endpoint (+ blob, + MAC with a secret).
    Welcome = 2,
    /// Either side: my QP is ready to receive.
    Ready = 3,
    /// Client → server: I hold a shared secret; here is my nonce.
    Challenge = 4,
    /// Server → client: my nonce, and a MAC over both nonces proving I hold the secret.
    Proof = 5,
    /// Either side: I give up; `code` says why ([`Refusal`]).
    Refused = 6,
}

/// Why a side sent `Refused` (the message's `code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Refusal {
    /// The sender requires a shared secret; the receiver offered none.
    SecretRequired = 1,
    /// The sender has no shared secret; the receiver required one.
    NoSecret = 2,
    /// The receiver's MAC did not match the sender's secret.
    WrongSecret = 3,
}

impl Refusal {
    /// The failure the *receiver* of this refusal reports.
    pub fn failure(self) -> AuthFailure {
        match self {
            Refusal::SecretRequired => AuthFailure::NoLocalSecret,
            Refusal::NoSecret => AuthFailure::NoPeerSecret,
            Refusal::WrongSecret => AuthFailure::WrongSecret,
        }
    }
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// What it announces.
    pub kind: Kind,
    /// Why it refuses (`Refused` only).
    pub refusal: Option<Refusal>,
    /// The sender's QP endpoint (`Hello`, `Welcome`; optional in `Ready`).
    pub endpoint: Option<Endpoint>,
    /// The sender's control-channel QP endpoint, if it offers one (`Hello`, `Welcome` only).
    pub control: Option<Endpoint>,
    /// The rights the sender's QP grants the receiver (`Hello`, `Welcome` only; remote rights
    /// only).
    pub rights: Access,
    /// The sender's nonce (`Challenge`, `Proof`), else zero.
    pub nonce: [u8; NONCE_LEN],
    /// The sender's MAC (`Proof`, and `Hello` / `Welcome` with a secret), else zero.
    pub mac: [u8; MAC_LEN],
    /// Application data (e.g. an encoded [`crate::RemoteBuf`]; `Hello` and `Welcome` only).
    pub blob: Vec<u8>,
}

fn malformed(why: String) -> Error {
    Error::Protocol(why)
}

/// Bytes of the magic and the version, which every version of the protocol starts with.
const PREFIX: usize = 6;

/// Checks the magic and the version (`prefix`: [`PREFIX`] bytes).
fn check_prefix(prefix: &[u8]) -> Result<()> {
    if prefix[..4] != MAGIC {
        return Err(malformed(format!("bad magic {:02x?} (not an mralloc peer?)", &prefix[..4])));
    }
    let version = u16::from_be_bytes([prefix[4], prefix[5]]);
    if version != VERSION {
        return Err(malformed(format!("peer speaks protocol version {version}, this build speaks {VERSION}")));
    }
    Ok(())
}

impl Message {
    /// A message of `kind` with an endpoint and a blob; no nonce, MAC or code.
    pub fn new(kind: Kind, endpoint: Option<Endpoint>, blob: Vec<u8>) -> Message {
        let (nonce, mac) = ([0; NONCE_LEN], [0; MAC_LEN]);
        Message { kind, refusal: None, endpoint, control: None, rights: Access::NONE, nonce, mac, blob }
    }

    /// A `Refused` message.
    pub fn refused(why: Refusal) -> Message {
        Message { refusal: Some(why), ..Message::new(Kind::Refused, None, Vec::new()) }
    }

    /// Encodes the message.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the blob exceeds [`MAX_BLOB`], or if the message breaks the
    /// rules [`Message::parse_header`] checks (so nothing this encodes is refused by a peer).
    pub fn encode(&self) -> Result<Vec<u8>> {
        if self.blob.len() > MAX_BLOB {
            return Err(Error::InvalidArgument(format!(
                "connection blob of {} bytes exceeds the {MAX_BLOB}-byte limit",
                self.blob.len()
            )));
        }
        let rights = encode_rights(self.rights);
        let fields = Fields { endpoint: self.endpoint.is_some(), control: self.control.is_some(), rights: rights != 0 };
        check_shape(self.kind, self.refusal, fields, self.blob.len()).map_err(|e| match e {
            Error::Protocol(why) => Error::InvalidArgument(why),
            e => e,
        })?;
        let mut b = Vec::with_capacity(HEADER + self.blob.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_be_bytes());
        b.push(self.kind as u8);
        b.push(self.refusal.map_or(0, |r| r as u8));
        b.push(rights);
        b.extend_from_slice(&self.endpoint.map_or([0; Endpoint::ENCODED_LEN], |e| e.to_bytes()));
        b.extend_from_slice(&self.control.map_or([0; Endpoint::ENCODED_LEN], |e| e.to_bytes()));
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(&self.mac);
        b.extend_from_slice(&(self.blob.len() as u32).to_be_bytes());
        b.extend_from_slice(&self.blob);
        Ok(b)
    }

    /// Parses the fixed header: the message without its blob, and the blob's length (checked
    /// against [`MAX_BLOB`] and the kind).
    ///
    /// # Errors
    /// [`Error::Protocol`] for a truncated header, a wrong magic or version (an older peer's
    /// message is refused by its version, before any other field is read), an unknown kind or
    /// refusal code, a rights byte with a bit no right has, a malformed endpoint, a blob length above [`MAX_BLOB`], or fields the kind
    /// does not allow (an endpoint, control endpoint, blob or refusal code where it has none, a
    /// `Hello` or `Welcome` without an endpoint, a `Refused` without a code).
    pub fn parse_header(h: &[u8]) -> Result<(Message, usize)> {
        if h.len() < HEADER {
            return Err(malformed(format!("truncated header: {} of {HEADER} bytes", h.len())));
        }
        check_prefix(&h[..PREFIX])?;
        let kind = match h[6] {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Ready,
            4 => Kind::Challenge,
            5 => Kind::Proof,
            6 => Kind::Refused,
            k => return Err(malformed(format!("unknown message kind {k}"))),
        };
        let refusal = match h[7] {
            0 => None,
            1 => Some(Refusal::SecretRequired),
            2 => Some(Refusal::NoSecret),
            3 => Some(Refusal::WrongSecret),
            c => return Err(malformed(format!("unknown refusal code {c}"))),
        };
        let rights = decode_rights(h[AT_RIGHTS])?;
        let endpoint_at = |raw: &[u8]| -> Result<Option<Endpoint>> {
            if raw.iter().all(|&x| x == 0) {
                return Ok(None);
            }
            Endpoint::from_bytes(raw).map(Some).map_err(|e| malformed(e.to_string()))
        };
        let endpoint = endpoint_at(&h[AT_ENDPOINT..AT_CONTROL])?;
        let control = endpoint_at(&h[AT_CONTROL..AT_NONCE])?;
        let len = u32::from_be_bytes([h[AT_LEN], h[AT_LEN + 1], h[AT_LEN + 2], h[AT_LEN + 3]]) as usize;
        if len > MAX_BLOB {
            return Err(malformed(format!("blob length {len} exceeds the {MAX_BLOB}-byte limit")));
        }
        let fields = Fields { endpoint: endpoint.is_some(), control: control.is_some(), rights: !rights.is_empty() };
        check_shape(kind, refusal, fields, len)?;
        let mut m = Message::new(kind, endpoint, Vec::new());
        m.refusal = refusal;
        m.rights = rights;
        m.control = control;
        m.nonce.copy_from_slice(&h[AT_NONCE..AT_MAC]);
        m.mac.copy_from_slice(&h[AT_MAC..AT_LEN]);
        Ok((m, len))
    }

    /// Decodes a whole message from a byte slice (header and blob, nothing more).
    ///
    /// # Errors
    /// As [`Message::parse_header`]; [`Error::Protocol`] if the blob's length differs from the
    /// header's.
    #[cfg(test)]
    pub fn decode(b: &[u8]) -> Result<Message> {
        let (mut m, len) = Message::parse_header(b)?;
        let rest = &b[HEADER..];
        if rest.len() != len {
            return Err(malformed(format!("blob is {} bytes, header says {len}", rest.len())));
        }
        m.blob = rest.to_vec();
        Ok(m)
    }

    /// Writes the message to a setup stream.
    ///
    /// # Errors
    /// As [`Message::encode`]; [`Error::Io`] if writing fails or times out.
    pub(crate) async fn write_to(&self, w: &mut impl Wire) -> Result<()> {
        let bytes = self.encode()?;
        wire::write_all(w, &bytes).await.map_err(|e| io("sending a connection message", e))
    }

    /// Reads one message from a setup stream (bounded by [`MAX_BLOB`]).
    ///
    /// # Errors
    /// As [`Message::parse_header`]; [`Error::Io`] if reading fails, times out or the peer
    /// closes the stream mid-message.
    pub(crate) async fn read_from(r: &mut impl Wire) -> Result<Message> {
        let mut h = [0u8; HEADER];
        // Magic and version first: another version's header may be shorter (waiting for the
        // rest would hold the exchange up until its deadline).
        wire::read_exact(r, &mut h[..PREFIX]).await.map_err(|e| io("reading a connection message", e))?;
        check_prefix(&h[..PREFIX])?;
        wire::read_exact(r, &mut h[PREFIX..]).await.map_err(|e| io("reading a connection message", e))?;
        let (mut m, len) = Message::parse_header(&h)?;
        let mut blob = vec![0u8; len];
        wire::read_exact(r, &mut blob).await.map_err(|e| io("reading a connection message's blob", e))?;
        m.blob = blob;
        Ok(m)
    }

    /// [`Message::write_to`] a blocking stream.
    #[cfg(test)]
    pub fn send(&self, w: &mut (impl Read + Write)) -> Result<()> {
        wire::block_on(self.write_to(&mut Plain(w)))
    }

    /// [`Message::read_from`] a blocking reader.
    #[cfg(test)]
    pub fn recv(r: &mut impl Read) -> Result<Message> {
        wire::block_on(Message::read_from(&mut Plain(wire::ReadOnly(r))))
    }
}

/// The rights a QP grants, as the rights byte carries them: bit 0 RDMA WRITE, bit 1 READ, bit 2
/// atomics.
const RIGHT_BITS: [(Access, u8); 3] = [(Access::REMOTE_WRITE, 1), (Access::REMOTE_READ, 2), (Access::REMOTE_ATOMIC, 4)];

/// The rights byte of `rights` (non-remote bits ignored).
pub(crate) fn encode_rights(rights: Access) -> u8 {
    RIGHT_BITS.iter().filter(|(a, _)| rights.contains(*a)).fold(0, |b, (_, bit)| b | bit)
}

/// The rights a rights byte names.
///
/// # Errors
/// [`Error::Protocol`] if it has a bit no right has.
pub(crate) fn decode_rights(byte: u8) -> Result<Access> {
    let known = RIGHT_BITS.iter().fold(0, |b, (_, bit)| b | bit);
    if byte & !known != 0 {
        return Err(malformed(format!("rights byte {byte:#04x} has bits no right has")));
    }
    Ok(RIGHT_BITS.iter().filter(|(_, bit)| byte & bit != 0).fold(Access::NONE, |r, (a, _)| r | *a))
}

/// Which optional fields a message has set.
struct Fields {
    endpoint: bool,
    control: bool,
    rights: bool,
}

/// Which fields a kind may use: an endpoint is required in `Hello` / `Welcome` and absent from
/// the authentication kinds; only `Hello` / `Welcome` carry a control endpoint, rights or a
/// blob; only `Refused` (and it always) has a code.
fn check_shape(kind: Kind, refusal: Option<Refusal>, fields: Fields, blob_len: usize) -> Result<()> {
    let Fields { endpoint, control, rights } = fields;
    let carries = matches!(kind, Kind::Hello | Kind::Welcome);
    if !carries && control {
        return Err(malformed(format!("a {kind:?} message with a control endpoint")));
    }
    if !carries && rights {
        return Err(malformed(format!("a {kind:?} message with rights")));
    }
    if carries && !endpoint {
        return Err(malformed(format!("a {kind:?} message without an endpoint")));
    }
    if matches!(kind, Kind::Challenge | Kind::Proof | Kind::Refused) && endpoint {
        return Err(malformed(format!("a {kind:?} message with an endpoint")));
    }
    if !carries && blob_len != 0 {
        return Err(malformed(format!("a {kind:?} message with a {blob_len}-byte blob")));
    }
    if (kind == Kind::Refused) != refusal.is_some() {
        return Err(malformed(format!("a {kind:?} message with refusal code {refusal:?}")));
    }
    Ok(())
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
#[path = "exchange_tests.rs"]
mod tests;
