//! What rides in RDMA CM private data: `[RIGHTS_TAG | rights][len][blob]`, then, from a side
//! that offers a control channel, `[CONTROL_MARKER][qpn: 3 bytes, little endian]` (the control
//! QP's number). The CM pads private data with zeros, so a side that offers none (a blocking
//! connection) leaves a zero where the marker would be.
//!
//! The first byte carries the rights the sender's QP grants the receiver (the TCP exchange's
//! rights byte, [`encode_rights`], in its low bits) under a tag no older mralloc sends there:
//! their first byte was the blob's length, at most [`MAX_CM_ACCEPT_BLOB`] + 1. Such a peer's
//! private data is refused as an older protocol, not misread.

use crate::error::{Error, Result};
use crate::transfer::setup::exchange::{decode_rights, encode_rights};
use crate::verbs::Access;

/// Largest blob a CM connect request carries: the REQ private data of the TCP port space holds
/// 56 bytes, one of which is the rights byte and one the blob's length (the CM pads private
/// data with zeros).
pub const MAX_CM_BLOB: usize = 54;
/// Largest blob an accept carries (REP private data: 196 bytes, one for the rights, one for the
/// length).
pub const MAX_CM_ACCEPT_BLOB: usize = 194;
/// The high bits of the first byte: above any blob length an older peer put there.
const RIGHTS_TAG: u8 = 0xe0;
/// The bits of the first byte the rights take.
const RIGHTS_MASK: u8 = 0x1f;
/// Bytes the control channel's QP number takes after the blob.
const CONTROL_LEN: usize = 4;
const CONTROL_MARKER: u8 = 0xc7;
/// Largest blob an async RDMA CM connect request carries (`AsyncConnection::connect_cm`,
/// feature `tokio`): [`MAX_CM_BLOB`] less the 4 bytes that offer the control channel.
pub const MAX_ASYNC_CM_BLOB: usize = MAX_CM_BLOB - CONTROL_LEN;
/// Largest blob an async RDMA CM accept carries (`AsyncCmListener`, feature `tokio`):
/// [`MAX_CM_ACCEPT_BLOB`] less the 4 bytes that offer the control channel.
pub const MAX_ASYNC_CM_ACCEPT_BLOB: usize = MAX_CM_ACCEPT_BLOB - CONTROL_LEN;

/// `[rights][len][blob]` and, if `control` is some, the marker and its QP number. `rights`: what
/// this side's QP grants the peer.
pub(crate) fn frame(rights: Access, blob: &[u8], control: Option<u32>) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + blob.len() + CONTROL_LEN);
    v.push(RIGHTS_TAG | encode_rights(rights));
    v.push(blob.len() as u8);
    v.extend_from_slice(blob);
    if let Some(qpn) = control {
        v.push(CONTROL_MARKER);
        v.extend_from_slice(&qpn.to_le_bytes()[..3]);
    }
    v
}

/// What [`unframe`] finds: the peer's blob, its control QP number (if it offered one) and the
/// rights it grants (its word: untrusted).
pub(crate) type Unframed = (Vec<u8>, Option<u32>, Access);

/// Undoes [`frame`]. A first byte without the rights tag (an older peer, or none at all), a
/// rights byte with bits no right has, a length larger than what arrived, or a marker not
/// followed by a whole QP number, is a protocol error.
pub(crate) fn unframe(private: &[u8]) -> Result<Unframed> {
    let Some((&first, rest)) = private.split_first() else {
        return Err(Error::Protocol(
            "RDMA CM private data is empty: the peer is no mralloc peer of this version".into(),
        ));
    };
    if first & !RIGHTS_MASK != RIGHTS_TAG {
        return Err(Error::Protocol(format!(
            "RDMA CM private data starts with {first:#04x}, not the rights byte: the peer runs an older mralloc \
             (this one's CM setup carries the rights each side grants) or is none"
        )));
    }
    let rights = decode_rights(first & RIGHTS_MASK)?;
    let Some((&len, rest)) = rest.split_first() else { return Ok((Vec::new(), None, rights)) };
    let len = len as usize;
    if len > rest.len() {
        return Err(Error::Protocol(format!("RDMA CM private data claims {len} bytes, {} arrived", rest.len())));
    }
    let (blob, after) = rest.split_at(len);
    let control = match after {
        [CONTROL_MARKER, a, b, c, ..] => Some(u32::from_le_bytes([*a, *b, *c, 0])),
        [CONTROL_MARKER, ..] => {
            return Err(Error::Protocol("RDMA CM private data: a control channel offer cut short".into()))
        }
        _ => None,
    };
    Ok((blob.to_vec(), control, rights))
}

/// Refuses an accept blob longer than what the REP carries, with the control channel's offer
/// (`control`) or without.
pub(crate) fn check_accept_blob(blob: &[u8], control: bool) -> Result<()> {
    if control {
        check_blob(blob, MAX_ASYNC_CM_ACCEPT_BLOB, "an async RDMA CM accept blob")
    } else {
        check_blob(blob, MAX_CM_ACCEPT_BLOB, "an RDMA CM accept blob")
    }
}

/// Refuses a blob longer than `max` bytes.
pub(crate) fn check_blob(blob: &[u8], max: usize, what: &str) -> Result<()> {
    if blob.len() > max {
        return Err(Error::InvalidArgument(format!("{what} holds at most {max} bytes, got {}", blob.len())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Access = Access::REMOTE_WRITE;

    #[test]
    fn framing_with_and_without_a_control_offer() {
        let mut padded = frame(W, b"remote", None);
        padded.resize(56, 0);
        assert_eq!(unframe(&padded).unwrap(), (b"remote".to_vec(), None, W), "zero padding offers nothing");
        assert!(matches!(unframe(&[RIGHTS_TAG, 200, 1, 2]), Err(Error::Protocol(_))));

        let mut offer = frame(Access::NONE, &[9; MAX_ASYNC_CM_BLOB], Some(0x00ab_cdef));
        assert_eq!(offer.len(), MAX_CM_BLOB + 2, "a full async blob and the offer fill the REQ");
        assert_eq!(unframe(&offer).unwrap(), (vec![9; MAX_ASYNC_CM_BLOB], Some(0x00ab_cdef), Access::NONE));
        offer.truncate(offer.len() - 1);
        assert!(matches!(unframe(&offer), Err(Error::Protocol(_))), "a cut offer is refused");
        let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        let mut reply = frame(all, b"", Some(17));
        reply.resize(196, 0);
        assert_eq!(unframe(&reply).unwrap(), (Vec::new(), Some(17), all));
        let full = frame(all, &[1; MAX_CM_ACCEPT_BLOB], None);
        assert_eq!(full.len(), 196, "a full accept blob fills the REP");

        assert!(check_blob(&[0; MAX_CM_BLOB], MAX_CM_BLOB, "blob").is_ok());
        assert!(matches!(check_blob(&[0; MAX_CM_BLOB + 1], MAX_CM_BLOB, "blob"), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn rights_travel_and_an_older_or_garbled_first_byte_is_refused() {
        for rights in [Access::NONE, W, Access::REMOTE_READ, Access::REMOTE_ATOMIC, W | Access::REMOTE_READ] {
            assert_eq!(unframe(&frame(rights, b"x", None)).unwrap().2, rights);
        }
        // Non-remote bits are not rights: they do not travel.
        assert_eq!(unframe(&frame(Access::LOCAL_WRITE | W, b"", None)).unwrap().2, W);
        // An older peer's private data starts with the blob's length (up to 195), or is padding.
        for old in [vec![0u8; 56], vec![6, b'r', b'e', b'm', b'o', b't', b'e'], vec![195; 196], vec![]] {
            let e = unframe(&old).unwrap_err();
            assert!(matches!(e, Error::Protocol(_)), "{e}");
        }
        assert!(unframe(&[0]).unwrap_err().to_string().contains("older mralloc"));
        // The tag with a bit no right has.
        for garbled in [RIGHTS_TAG | 0x08, RIGHTS_TAG | 0x10, 0xc4, 0xff] {
            let e = unframe(&[garbled, 0]).unwrap_err();
            assert!(matches!(e, Error::Protocol(_)), "{garbled:#x}: {e}");
        }
    }
}
