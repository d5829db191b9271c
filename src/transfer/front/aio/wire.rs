//! Control-channel messages: fixed 256-byte frames, versioned, every field checked on receipt.
//!
//! ```text
//! "mRcc" | version u8 | kind u8 | code u8 | access u8 | seq u64 | handle u64 | addr u64
//!        | len u64 | rkey u32 | tag u64 | keys u8 | 11 zero bytes
//!        | 4 x key slot (gid [16] | qpn u32 | rkey u32 | handle u64), the unused ones zero
//!        | 64 zero bytes
//! ```
//!
//! A field a kind does not use is zero. Remote memory is requested with `Request` (seq, len,
//! access) and answered with `Granted` (seq, handle, addr, len, rkey) or `Refused` (seq, code,
//! len: the most the owner would grant now); `Release` (handle) gives it back, `HandOver`
//! (handle, tag) gives it back with its contents for the owner to keep; `Push` (handle, addr,
//! len, rkey, access, tag) grants memory unasked. `Ping` keeps a quiet channel checked, `Bye`
//! says the sender is closing.
//!
//! Rail groups (version 2): `RailsRequest` (seq, len, access) asks for memory reachable through
//! every rail of the group, answered with `RailsGranted` (seq, addr, len, keys) or `Refused`;
//! `RailsPush` (addr, len, access, tag, keys) grants such memory unasked. Each key slot names
//! one rail's key: the GID and queue pair number of the owner's end of that rail (the rail's
//! connection, as the borrower's end addresses it), the rkey, and the handle under which that
//! rail's control channel knows it (released there with `Release`). The exchange that sets up
//! a connection carries the protocol version its control channel speaks: peers of another
//! version are refused there.

use crate::error::{Error, RemoteRefusal as RefusalCode, Result};
use crate::remote::RemoteBuf;
use crate::remote_desc::RemoteDesc;
use crate::verbs::Gid;

/// Most keys a rails message carries: a descriptor's.
pub(crate) const MAX_KEYS: usize = RemoteDesc::MAX_DEVICES;
/// Bytes of the fixed part of a frame.
const HEAD: usize = 64;
/// Bytes of a key slot.
const SLOT: usize = 16 + 4 + 4 + 8;
/// Bytes of the key slots' end.
const SLOTS_END: usize = HEAD + MAX_KEYS * SLOT;
/// Bytes of a frame (a power of two: the size of the scratch words frames travel in).
pub(crate) const FRAME: usize = 256;
const _: () = assert!(SLOTS_END <= FRAME && FRAME.is_power_of_two());
const MAGIC: [u8; 4] = *b"mRcc";
/// Version of the control protocol this build speaks (2: 256-byte frames, the rails kinds).
pub(crate) const VERSION: u8 = 2;

/// Access bits in a frame (the rights asked for or granted).
pub(crate) const READ: u8 = 1;
pub(crate) const WRITE: u8 = 2;

/// One rail's key of memory lent over a rail group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RailKey {
    /// The GID of the owner's end of the rail (what the borrower's end addresses).
    gid: Gid,
    /// The queue pair number of the owner's end of the rail: names the connection.
    qpn: u32,
    rkey: u32,
    /// The entry's name on that rail's control channel.
    handle: u64,
}

impl RailKey {
    pub(crate) fn new(gid: Gid, qpn: u32, rkey: u32, handle: u64) -> RailKey {
        RailKey { gid, qpn, rkey, handle }
    }

    pub(crate) fn gid(&self) -> Gid {
        self.gid
    }

    pub(crate) fn qpn(&self) -> u32 {
        self.qpn
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.rkey
    }

    pub(crate) fn handle(&self) -> u64 {
        self.handle
    }
}

/// The keys of memory lent over a rail group: 1..=[`MAX_KEYS`], each GID once, none zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RailKeys {
    n: u8,
    keys: [RailKey; MAX_KEYS],
}

impl RailKeys {
    /// `None` unless 1..=[`MAX_KEYS`] keys with distinct, non-zero GIDs.
    pub(crate) fn new(keys: &[RailKey]) -> Option<RailKeys> {
        if keys.is_empty() || keys.len() > MAX_KEYS {
            return None;
        }
        for (i, k) in keys.iter().enumerate() {
            if k.gid.is_zero() || keys[..i].iter().any(|o| o.gid == k.gid) {
                return None;
            }
        }
        let mut all = [RailKey::default(); MAX_KEYS];
        all[..keys.len()].copy_from_slice(keys);
        Some(RailKeys { n: keys.len() as u8, keys: all })
    }

    pub(crate) fn as_slice(&self) -> &[RailKey] {
        &self.keys[..self.n as usize]
    }
}

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
    RailsRequest { seq: u64, len: u64, access: u8 },
    RailsGranted { seq: u64, addr: u64, len: u64, keys: RailKeys },
    RailsPush { addr: u64, len: u64, access: u8, tag: u64, keys: RailKeys },
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
const KEYS: usize = 52;
const END: usize = 53;

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
    keys: Option<RailKeys>,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
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
            Msg::RailsRequest { seq, len, access } => Fields { kind: 9, seq, len, access, ..f },
            Msg::RailsGranted { seq, addr, len, keys } => Fields { kind: 10, seq, addr, len, keys: Some(keys), ..f },
            Msg::RailsPush { addr, len, access, tag, keys } => {
                Fields { kind: 11, addr, len, access, tag, keys: Some(keys), ..f }
            }
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
        if let Some(keys) = f.keys {
            b[KEYS] = keys.n;
            for (k, slot) in keys.as_slice().iter().zip(b[HEAD..].chunks_exact_mut(SLOT)) {
                slot[..16].copy_from_slice(k.gid.as_bytes());
                slot[16..20].copy_from_slice(&k.qpn.to_be_bytes());
                slot[20..24].copy_from_slice(&k.rkey.to_be_bytes());
                slot[24..32].copy_from_slice(&k.handle.to_be_bytes());
            }
        }
        b
    }

    /// Decodes a received message of `got` bytes.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a frame of another size, a wrong magic or version, an unknown
    /// kind, access or refusal code, a field the kind does not use set, a granted range that
    /// is empty or wraps around, a rails message whose keys are none, too many, or name a GID
    /// twice or a zero GID.
    pub(crate) fn decode(b: &[u8]) -> Result<Msg> {
        // Magic and version first: another version's frame may have another size.
        if b.len() < 5 || b[..4] != MAGIC {
            return Err(bad(format!("bad magic {:02x?}", &b[..b.len().min(4)])));
        }
        if b[4] != VERSION {
            return Err(bad(format!("peer speaks control version {}, this build speaks {VERSION}", b[4])));
        }
        let b: &[u8; FRAME] =
            b.try_into().map_err(|_| bad(format!("a {}-byte message (frames are {FRAME})", b.len())))?;
        if b[END..HEAD].iter().chain(&b[SLOTS_END..]).any(|&x| x != 0) {
            return Err(bad("reserved bytes set".into()));
        }
        let (seq, handle, addr, len, tag) =
            (u64_at(b, SEQ), u64_at(b, HANDLE), u64_at(b, ADDR), u64_at(b, LEN), u64_at(b, TAG));
        let rkey = u32_at(b, RKEY);
        let (code, access) = (b[CODE], b[ACCESS]);
        let range = || -> Result<()> {
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(bad(format!("granted range of {len} bytes at {addr:#x}")));
            }
            Ok(())
        };
        let remote = || -> Result<RemoteBuf> {
            range()?;
            Ok(RemoteBuf { addr, len, rkey })
        };
        let rights = || -> Result<u8> {
            if access == 0 || access & !(READ | WRITE) != 0 {
                return Err(bad(format!("access bits {access:#x}")));
            }
            Ok(access)
        };
        let keys = || -> Result<RailKeys> {
            let n = usize::from(b[KEYS]);
            if n > MAX_KEYS {
                return Err(bad(format!("{n} rail keys (at most {MAX_KEYS})")));
            }
            let mut keys = [RailKey::default(); MAX_KEYS];
            for (k, slot) in keys.iter_mut().zip(b[HEAD..].chunks_exact(SLOT)).take(n) {
                let gid = Gid::from_bytes(slot[..16].try_into().expect("16 bytes"));
                *k = RailKey { gid, qpn: u32_at(slot, 16), rkey: u32_at(slot, 20), handle: u64_at(slot, 24) };
            }
            range()?;
            RailKeys::new(&keys[..n]).ok_or_else(|| bad(format!("rail keys {:?}", &keys[..n])))
        };
        let m = match b[KIND] {
            1 | 9 if len == 0 => return Err(bad("a request for 0 bytes".into())),
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
            9 => Msg::RailsRequest { seq, len, access: rights()? },
            10 => Msg::RailsGranted { seq, addr, len, keys: keys()? },
            11 => Msg::RailsPush { addr, len, access: rights()?, tag, keys: keys()? },
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

    fn gid(last: u8) -> Gid {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[15] = last;
        Gid::from_bytes(raw)
    }

    fn keys() -> RailKeys {
        let k = |i: u8| RailKey {
            gid: gid(i),
            qpn: 0x11 * u32::from(i),
            rkey: 0x100 + u32::from(i),
            handle: u64::from(i) * 7,
        };
        RailKeys::new(&[k(1), k(2)]).unwrap()
    }

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
            Msg::RailsRequest { seq: 9, len: 1 << 20, access: WRITE },
            Msg::RailsGranted { seq: 9, addr: r.addr, len: r.len, keys: keys() },
            Msg::RailsPush { addr: r.addr, len: r.len, access: READ | WRITE, tag: 5, keys: keys() },
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
        assert!(Msg::decode(&good[..3]).is_err());
        let mut v1 = good[..64].to_vec();
        v1[4] = 1; // a version-1 peer's frame (64 bytes) is refused by its version
        assert!(Msg::decode(&v1).unwrap_err().to_string().contains("version 1, this build speaks 2"));
        let mut b = good;
        b[KIND] = 99;
        assert!(Msg::decode(&b).unwrap_err().to_string().contains("kind 99"));
        let mut b = good;
        b[TAG] = 1; // a Release carries no tag
        assert!(Msg::decode(&b).unwrap_err().to_string().contains("does not use"));
        let mut b = good;
        b[HEAD + 3] = 1; // nor keys
        assert!(Msg::decode(&b).unwrap_err().to_string().contains("does not use"));
        let mut b = good;
        b[FRAME - 1] = 1;
        assert!(Msg::decode(&b).unwrap_err().to_string().contains("reserved"));
        let mut b = Msg::Request { seq: 1, len: 8, access: READ }.encode();
        b[ACCESS] = 4;
        assert!(Msg::decode(&b).is_err());
        let wrap = Msg::Granted { seq: 1, handle: 1, remote: RemoteBuf { addr: u64::MAX, len: 2, rkey: 1 } };
        assert!(Msg::decode(&wrap.encode()).is_err());
    }

    #[test]
    fn rails_keys_are_checked() {
        let m = Msg::RailsGranted { seq: 1, addr: 4096, len: 64, keys: keys() };
        let good = m.encode();
        // No keys, too many, a repeated GID, a zero GID, a key slot past the count.
        for (at, val) in [(KEYS, 0u8), (KEYS, 5), (HEAD + SLOT + 15, 1), (HEAD + SLOT + 15, 0), (HEAD + 2 * SLOT, 1)] {
            let mut b = good;
            b[at] = val;
            if at == HEAD + SLOT + 15 && val == 0 {
                b[HEAD + SLOT + 10] = 0; // all zero
                b[HEAD + SLOT + 11] = 0;
            }
            assert!(Msg::decode(&b).is_err(), "byte {at} = {val}");
        }
        let wraps = Msg::RailsPush { addr: u64::MAX - 1, len: 4, access: READ, tag: 0, keys: keys() };
        assert!(Msg::decode(&wraps.encode()).is_err());
        assert!(RailKeys::new(&[]).is_none());
        assert!(RailKeys::new(&[RailKey::default()]).is_none(), "a zero GID");
    }

    proptest! {
        #[test]
        fn decoding_never_panics_and_accepts_one_spelling(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(m) = Msg::decode(&bytes) {
                prop_assert_eq!(&m.encode()[..], &bytes[..]);
            }
        }

        #[test]
        fn corrupted_frames_are_refused_or_reencode_the_same(which in 0usize..11, pos in 0usize..FRAME, val in any::<u8>()) {
            let mut b = samples()[which].encode();
            b[pos] = val;
            if let Ok(m) = Msg::decode(&b) {
                prop_assert_eq!(m.encode(), b);
            }
        }
    }
}
