//! Control-channel messages: fixed 64-byte frames, versioned, every field checked on receipt.
//!
//! ```text
//! "mRcc" | version u8 | kind u8 | code u8 | access u8 | seq u64 | handle u64 | addr u64
//!        | len u64 | rkey u32 | tag u64 | 12 zero bytes
//! ```
//!
//! A field a kind does not use is zero. Remote memory is requested with `Request` (seq, len,
//! access) and answered with `Granted` (seq, handle, addr, len, rkey) or `Refused` (seq, code,
//! len: the most the owner would grant now); `Release` (handle) gives it back, `HandOver`
//! (handle, tag) gives it back with its contents for the owner to keep; `Push` (handle, addr,
//! len, rkey, access, tag) grants memory unasked. `Ping` keeps a quiet channel checked, `Bye`
//! says the sender is closing.

use crate::error::{Error, RemoteRefusal as RefusalCode, Result};
use crate::remote::RemoteBuf;

/// Bytes of a frame.
pub(crate) const FRAME: usize = 64;
const MAGIC: [u8; 4] = *b"mRcc";
/// Version of the control protocol this build speaks.
pub(crate) const VERSION: u8 = 1;

/// Access bits in a frame (the rights asked for or granted).
pub(crate) const READ: u8 = 1;
pub(crate) const WRITE: u8 = 2;

/// A control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Msg {
    Request { seq: u64, len: u64, access: u8 },
    Granted { seq: u64, handle: u64, remote: RemoteBuf },
    Refused { seq: u64, code: RefusalCode, limit: u64 },
    Release { handle: u64 },
    HandOver { handle: u64, tag: u64 },
    Push { handle: u64, remote: RemoteBuf, access: u8, tag: u64 },
    Ping,
    Bye,
}

/// Field offsets.
const KIND: usize = 5;
const CODE: usize = 6;
const ACCESS: usize = 7;
const SEQ: usize = 8;
const HANDLE: usize = 16;
const ADDR: usize = 24;
const LEN: usize = 32;
const RKEY: usize = 40;
const TAG: usize = 44;
const END: usize = 52;

#[derive(Default)]
struct Fields {
    kind: u8,
    code: u8,
    access: u8,
    seq: u64,
    handle: u64,
    addr: u64,
    len: u64,
    rkey: u32,
    tag: u64,
}

fn u64_at(b: &[u8; FRAME], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn bad(why: String) -> Error {
    Error::Protocol(format!("control channel: {why}"))
}

impl Msg {
    fn fields(&self) -> Fields {
        let f = Fields::default();
        let remote = |r: &RemoteBuf, f: Fields| Fields { addr: r.addr, len: r.len, rkey: r.rkey, ..f };
        match *self {
            Msg::Request { seq, len, access } => Fields { kind: 1, seq, len, access, ..f },
            Msg::Granted { seq, handle, remote: r } => remote(&r, Fields { kind: 2, seq, handle, ..f }),
            Msg::Refused { seq, code, limit } => Fields { kind: 3, seq, code: code as u8, len: limit, ..f },
            Msg::Release { handle } => Fields { kind: 4, handle, ..f },
            Msg::HandOver { handle, tag } => Fields { kind: 5, handle, tag, ..f },
            Msg::Push { handle, remote: r, access, tag } => remote(&r, Fields { kind: 6, handle, access, tag, ..f }),
            Msg::Ping => Fields { kind: 7, ..f },
            Msg::Bye => Fields { kind: 8, ..f },
        }
    }

    /// The frame.
    pub(crate) fn encode(&self) -> [u8; FRAME] {
        let f = self.fields();
        let mut b = [0u8; FRAME];
        b[..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[KIND] = f.kind;
        b[CODE] = f.code;
        b[ACCESS] = f.access;
        b[SEQ..SEQ + 8].copy_from_slice(&f.seq.to_be_bytes());
        b[HANDLE..HANDLE + 8].copy_from_slice(&f.handle.to_be_bytes());
        b[ADDR..ADDR + 8].copy_from_slice(&f.addr.to_be_bytes());
        b[LEN..LEN + 8].copy_from_slice(&f.len.to_be_bytes());
        b[RKEY..RKEY + 4].copy_from_slice(&f.rkey.to_be_bytes());
        b[TAG..TAG + 8].copy_from_slice(&f.tag.to_be_bytes());
        b
    }

    /// Decodes a received message of `got` bytes.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a frame of another size, a wrong magic or version, an unknown
    /// kind, access or refusal code, a field the kind does not use set, a granted range that
    /// is empty or wraps around.
    pub(crate) fn decode(b: &[u8]) -> Result<Msg> {
        let b: &[u8; FRAME] =
            b.try_into().map_err(|_| bad(format!("a {}-byte message (frames are {FRAME})", b.len())))?;
        if b[..4] != MAGIC {
            return Err(bad(format!("bad magic {:02x?}", &b[..4])));
        }
        if b[4] != VERSION {
            return Err(bad(format!("peer speaks control version {}, this build speaks {VERSION}", b[4])));
        }
        if b[END..].iter().any(|&x| x != 0) {
            return Err(bad("reserved bytes set".into()));
        }
        let (seq, handle, addr, len, tag) =
            (u64_at(b, SEQ), u64_at(b, HANDLE), u64_at(b, ADDR), u64_at(b, LEN), u64_at(b, TAG));
        let rkey = u32::from_be_bytes(b[RKEY..RKEY + 4].try_into().expect("4 bytes"));
        let (code, access) = (b[CODE], b[ACCESS]);
        let remote = || -> Result<RemoteBuf> {
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(bad(format!("granted range of {len} bytes at {addr:#x}")));
            }
            Ok(RemoteBuf { addr, len, rkey })
        };
        let rights = || -> Result<u8> {
            if access == 0 || access & !(READ | WRITE) != 0 {
                return Err(bad(format!("access bits {access:#x}")));
            }
            Ok(access)
        };
        let m = match b[KIND] {
            1 if len == 0 => return Err(bad("a request for 0 bytes".into())),
            1 => Msg::Request { seq, len, access: rights()? },
            2 => Msg::Granted { seq, handle, remote: remote()? },
            3 => Msg::Refused {
                seq,
                code: RefusalCode::from_code(code).ok_or_else(|| bad(format!("refusal code {code}")))?,
                limit: len,
            },
            4 => Msg::Release { handle },
            5 => Msg::HandOver { handle, tag },
            6 => Msg::Push { handle, remote: remote()?, access: rights()?, tag },
            7 => Msg::Ping,
            8 => Msg::Bye,
            k => return Err(bad(format!("unknown message kind {k}"))),
        };
        // One spelling per message: every field the kind does not use is zero.
        if m.encode() != *b {
            return Err(bad(format!("a {m:?} message with fields its kind does not use")));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Msg> {
        let r = RemoteBuf { addr: 0x7f00_0000_1000, len: 4096, rkey: 0x1234 };
        vec![
            Msg::Request { seq: 7, len: 1 << 20, access: READ | WRITE },
            Msg::Granted { seq: 7, handle: 3, remote: r },
            Msg::Refused { seq: 8, code: RefusalCode::LimitReached, limit: 100 },
            Msg::Release { handle: 3 },
            Msg::HandOver { handle: 3, tag: u64::MAX },
            Msg::Push { handle: 4, remote: r, access: READ, tag: 9 },
            Msg::Ping,
            Msg::Bye,
        ]
    }

    #[test]
    fn round_trip_every_kind() {
        for m in samples() {
            assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn rejects_bad_frames() {
        let good = Msg::Release { handle: 1 }.encode();
        assert!(Msg::decode(&good[..63]).is_err());
        let mut b = good;
        b[4] = 2;
        assert!(Msg::decode(&b).unwrap_err().to_string().contains("this build speaks 1"));
        let mut b = good;
        b[KIND] = 99;
        assert!(Msg::decode(&b).unwrap_err().to_string().contains("kind 99"));
        let mut b = good;
        b[TAG] = 1; // a Release carries no tag
        assert!(Msg::decode(&b).unwrap_err().to_string().contains("does not use"));
        let mut b = Msg::Request { seq: 1, len: 8, access: READ }.encode();
        b[ACCESS] = 4;
        assert!(Msg::decode(&b).is_err());
        let wrap = Msg::Granted { seq: 1, handle: 1, remote: RemoteBuf { addr: u64::MAX, len: 2, rkey: 1 } };
        assert!(Msg::decode(&wrap.encode()).is_err());
    }

    proptest! {
        #[test]
        fn decoding_never_panics_and_accepts_one_spelling(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(m) = Msg::decode(&bytes) {
                prop_assert_eq!(&m.encode()[..], &bytes[..]);
            }
        }

        #[test]
        fn corrupted_frames_are_refused_or_reencode_the_same(which in 0usize..8, pos in 0usize..FRAME, val in any::<u8>()) {
            let mut b = samples()[which].encode();
            b[pos] = val;
            if let Ok(m) = Msg::decode(&b) {
                prop_assert_eq!(m.encode(), b);
            }
        }
    }
}
