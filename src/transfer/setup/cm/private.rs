//! What rides in RDMA CM private data: `[len][blob]`, then, from a side that offers a control
//! channel, `[CONTROL_MARKER][qpn: 3 bytes, little endian]` (the control QP's number). The CM
//! pads private data with zeros, so a side that offers none (a blocking connection) leaves a
//! zero where the marker would be.

use crate::error::{Error, Result};

/// Largest blob a CM connect request carries: the REQ private data of the TCP port space holds
/// 56 bytes, one of which is the blob's length (the CM pads private data with zeros).
pub const MAX_CM_BLOB: usize = 55;
/// Largest blob an accept carries (REP private data: 196 bytes, one for the length).
pub const MAX_CM_ACCEPT_BLOB: usize = 195;
/// Bytes the control channel's QP number takes after the blob.
const CONTROL_LEN: usize = 4;
const CONTROL_MARKER: u8 = 0xc7;
/// Largest blob an async RDMA CM connect request carries (`AsyncConnection::connect_cm`,
/// feature `tokio`): [`MAX_CM_BLOB`] less the 4 bytes that offer the control channel.
pub const MAX_ASYNC_CM_BLOB: usize = MAX_CM_BLOB - CONTROL_LEN;
/// Largest blob an async RDMA CM accept carries (`AsyncCmListener`, feature `tokio`):
/// [`MAX_CM_ACCEPT_BLOB`] less the 4 bytes that offer the control channel.
pub const MAX_ASYNC_CM_ACCEPT_BLOB: usize = MAX_CM_ACCEPT_BLOB - CONTROL_LEN;

/// `[len][blob]` and, if `control` is some, the marker and its QP number.
pub(crate) fn frame(blob: &[u8], control: Option<u32>) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + blob.len() + CONTROL_LEN);
    v.push(blob.len() as u8);
    v.extend_from_slice(blob);
    if let Some(qpn) = control {
        v.push(CONTROL_MARKER);
        v.extend_from_slice(&qpn.to_le_bytes()[..3]);
    }
    v
}

/// Undoes [`frame`]: the blob and the peer's control QP number, if it offered one. A length
/// larger than what arrived, or a marker not followed by a whole QP number, is a protocol error.
pub(crate) fn unframe(private: &[u8]) -> Result<(Vec<u8>, Option<u32>)> {
    let Some((&len, rest)) = private.split_first() else { return Ok((Vec::new(), None)) };
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
    Ok((blob.to_vec(), control))
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

    #[test]
    fn framing_with_and_without_a_control_offer() {
        let mut padded = frame(b"remote", None);
        padded.resize(56, 0);
        assert_eq!(unframe(&padded).unwrap(), (b"remote".to_vec(), None), "zero padding offers nothing");
        assert_eq!(unframe(&[]).unwrap(), (Vec::new(), None));
        assert!(matches!(unframe(&[200, 1, 2]), Err(Error::Protocol(_))));

        let mut offer = frame(&[9; MAX_ASYNC_CM_BLOB], Some(0x00ab_cdef));
        assert_eq!(offer.len(), MAX_CM_BLOB + 1, "a full async blob and the offer fill the REQ");
        assert_eq!(unframe(&offer).unwrap(), (vec![9; MAX_ASYNC_CM_BLOB], Some(0x00ab_cdef)));
        offer.truncate(offer.len() - 1);
        assert!(matches!(unframe(&offer), Err(Error::Protocol(_))), "a cut offer is refused");
        let mut reply = frame(b"", Some(17));
        reply.resize(196, 0);
        assert_eq!(unframe(&reply).unwrap(), (Vec::new(), Some(17)));

        assert!(check_blob(&[0; MAX_CM_BLOB], MAX_CM_BLOB, "blob").is_ok());
        assert!(matches!(check_blob(&[0; MAX_CM_BLOB + 1], MAX_CM_BLOB, "blob"), Err(Error::InvalidArgument(_))));
    }
}
