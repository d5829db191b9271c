//! The TCP exchange's endpoint and blob swap, optionally authenticated with a shared secret.
//!
//! With a secret `K` on both sides (HMAC-SHA-256 under `K`, a fresh 32-byte nonce per side
//! from the kernel's CSPRNG, every MAC under its own label):
//!
//! ```text
//! client                                              server
//!   Challenge { Nc }                           ──▶
//!                                              ◀──    Proof { Ns, MAC(K, "server-proof", Nc, Ns) }
//!   checks the proof: only then prepares its QP and sends its endpoint and blob
//!   Hello { ep_c, blob_c, MAC(K, "client-hello", Nc, Ns, ep_c, blob_c) }  ──▶
//!                          checks the MAC: only then prepares its QP and sends its blob
//!                                              ◀──    Welcome { ep_s, blob_s, MAC(K, "server-welcome", Nc, Ns, ep_s, blob_s) }
//!   checks the MAC: only then connects its QP
//! ```
//!
//! The secret never travels; a peer without it gets no QP, no endpoint and no blob from a
//! side that has it, and learns nothing it could reuse: every MAC covers both nonces, so a
//! recorded exchange replayed against a new nonce fails, and the labels keep one role's MAC
//! from passing as another's. MACs are compared in constant time. It authenticates, it does
//! not encrypt: the blobs (e.g. an rkey) cross the network in clear. A side that detects a
//! failure sends `Refused` (so both sides report [`Error::Authentication`]) and gives up.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{AuthFailure, Error, Result};
use crate::transfer::setup::exchange::{encode_rights, Kind, Message, Refusal, MAC_LEN, NONCE_LEN, VERSION};
use crate::transfer::setup::wire::Wire;
use crate::verbs::{Access, Endpoint};

/// A shared secret that both ends of a TCP connection setup must hold
/// ([`crate::transfer::SetupOptions::secret`]). Cheap to clone; its `Debug` output never shows the
/// bytes. Use at least 16 random bytes (e.g. from a key file).
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl Secret {
    /// A secret made of `bytes`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `bytes` is empty.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Secret> {
        let bytes = bytes.as_ref();
        if bytes.is_empty() {
            return Err(Error::InvalidArgument("a shared secret must not be empty".into()));
        }
        Ok(Secret(bytes.into()))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

type Nonce = [u8; NONCE_LEN];

/// A fresh nonce from the kernel's CSPRNG (`getrandom(2)`).
fn nonce() -> Result<Nonce> {
    let mut n = [0u8; NONCE_LEN];
    crate::os::fill_random(&mut n, "a nonce")?;
    Ok(n)
}

/// The MAC one role sends: HMAC-SHA-256 under the secret over a label naming the protocol
/// version and the role, both nonces, and (for `Hello` / `Welcome`) the sender's endpoint,
/// control endpoint (32 zero bytes if none), rights byte and length-prefixed blob.
fn mac(secret: &Secret, role: &str, nc: &Nonce, ns: &Nonce, sent: Option<&Message>) -> Result<Hmac<Sha256>> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&secret.0)
        .map_err(|_| Error::InvalidArgument("the shared secret cannot key HMAC-SHA-256".into()))?;
    m.update(format!("mralloc exchange v{VERSION} {role}\0").as_bytes());
    m.update(nc);
    m.update(ns);
    if let Some(sent) = sent {
        let bytes = |e: Option<Endpoint>| e.map_or([0; Endpoint::ENCODED_LEN], |e| e.to_bytes());
        m.update(&bytes(sent.endpoint));
        m.update(&bytes(sent.control));
        m.update(&[encode_rights(sent.rights)]);
        m.update(&(sent.blob.len() as u64).to_be_bytes());
        m.update(&sent.blob);
    }
    Ok(m)
}

fn tag(m: Hmac<Sha256>) -> [u8; MAC_LEN] {
    m.finalize().into_bytes().into()
}

/// Checks `got` against the expected MAC in constant time; on a mismatch tells the peer and
/// fails.
async fn verify(s: &mut impl Wire, expected: Hmac<Sha256>, got: &[u8; MAC_LEN]) -> Result<()> {
    if expected.verify_slice(got).is_err() {
        return Err(refuse(s, Refusal::WrongSecret).await);
    }
    Ok(())
}

/// Tells the peer why this side gives up (best effort: it may be gone) and returns the error
/// this side reports.
async fn refuse(s: &mut impl Wire, why: Refusal) -> Error {
    let _ = Message::refused(why).write_to(s).await;
    Error::Authentication(match why {
        Refusal::SecretRequired => AuthFailure::NoPeerSecret,
        Refusal::NoSecret => AuthFailure::NoLocalSecret,
        Refusal::WrongSecret => AuthFailure::WrongSecret,
    })
}

/// Checks that `m` is a `kind` message; a `Refused` one becomes the authentication error it
/// reports.
pub(crate) fn expect(m: Message, kind: Kind) -> Result<Message> {
    if let Some(why) = m.refusal {
        return Err(Error::Authentication(why.failure()));
    }
    if m.kind != kind {
        return Err(Error::Protocol(format!("expected a {kind:?} message, got {:?}", m.kind)));
    }
    Ok(m)
}

/// What an exchange produced: what `prepare` returned, this side's endpoint, the peer's
/// endpoint, control endpoint (if it offered a control channel), blob and the rights its QP
/// grants this side (its word: untrusted).
pub(crate) struct Exchanged<T> {
    pub prepared: T,
    pub me: Endpoint,
    pub peer: Endpoint,
    pub peer_control: Option<Endpoint>,
    pub peer_blob: Vec<u8>,
    pub peer_grants: Access,
}

/// What `prepare` returns: its product, this side's endpoint, control endpoint (if any) and the
/// rights its QP grants the peer.
pub(crate) type Prepared<T> = (T, Endpoint, Option<Endpoint>, Access);

/// The client's side up to the peer's `Welcome`. `prepare` (creating this side's QP) runs only
/// once the server proved it holds the secret (at once without one).
pub(crate) async fn client<T>(
    s: &mut impl Wire,
    secret: Option<&Secret>,
    blob: &[u8],
    prepare: impl FnOnce() -> Result<Prepared<T>>,
) -> Result<Exchanged<T>> {
    let nonces = match secret {
        None => None,
        Some(k) => {
            let nc = nonce()?;
            Message { nonce: nc, ..Message::new(Kind::Challenge, None, Vec::new()) }.write_to(s).await?;
            let proof = expect(Message::read_from(s).await?, Kind::Proof)?;
            let ns = proof.nonce;
            verify(s, mac(k, "server-proof", &nc, &ns, None)?, &proof.mac).await?;
            Some((k, nc, ns))
        }
    };
    let (prepared, me, control, rights) = prepare()?;
    let mut hello = Message { control, rights, ..Message::new(Kind::Hello, Some(me), blob.to_vec()) };
    if let Some((k, nc, ns)) = &nonces {
        hello.mac = tag(mac(k, "client-hello", nc, ns, Some(&hello))?);
    }
    hello.write_to(s).await?;
    let welcome = expect(Message::read_from(s).await?, Kind::Welcome)?;
    let peer = welcome.endpoint.ok_or_else(|| Error::Protocol("a Welcome message without an endpoint".into()))?;
    if let Some((k, nc, ns)) = &nonces {
        verify(s, mac(k, "server-welcome", nc, ns, Some(&welcome))?, &welcome.mac).await?;
    }
    let (peer_control, peer_grants) = (welcome.control, welcome.rights);
    Ok(Exchanged { prepared, me, peer, peer_control, peer_blob: welcome.blob, peer_grants })
}

/// A client the server heard from: its `Hello`, checked (with a secret, the client proved it
/// holds it). Only with one may [`welcome`] answer, so nothing of this side's (a QP, its blob)
/// goes to a client that has not proven itself.
pub(crate) struct Heard {
    hello: Message,
    nonces: Option<(Secret, Nonce, Nonce)>,
}

/// The server's side up to the client's checked `Hello`.
pub(crate) async fn hear(s: &mut impl Wire, secret: Option<&Secret>) -> Result<Heard> {
    let first = Message::read_from(s).await?;
    let (hello, nonces) = match (first.kind, secret) {
        (Kind::Hello, None) => (first, None),
        (Kind::Hello, Some(_)) => return Err(refuse(s, Refusal::SecretRequired).await),
        (Kind::Challenge, None) => return Err(refuse(s, Refusal::NoSecret).await),
        (Kind::Challenge, Some(k)) => {
            let (nc, ns) = (first.nonce, nonce()?);
            let proof = tag(mac(k, "server-proof", &nc, &ns, None)?);
            Message { nonce: ns, mac: proof, ..Message::new(Kind::Proof, None, Vec::new()) }.write_to(s).await?;
            let hello = expect(Message::read_from(s).await?, Kind::Hello)?;
            verify(s, mac(k, "client-hello", &nc, &ns, Some(&hello))?, &hello.mac).await?;
            (hello, Some((k.clone(), nc, ns)))
        }
        (kind, _) => {
            if let Some(why) = first.refusal {
                return Err(Error::Authentication(why.failure()));
            }
            return Err(Error::Protocol(format!("expected a Hello or Challenge message, got {kind:?}")));
        }
    };
    if hello.endpoint.is_none() {
        return Err(Error::Protocol("a Hello message without an endpoint".into()));
    }
    Ok(Heard { hello, nonces })
}

/// The server's `Welcome` to a client it [`hear`]d: what `prepared` made (this side's QP), its
/// endpoints, and `blob`.
pub(crate) async fn welcome<T>(
    s: &mut impl Wire,
    heard: Heard,
    (prepared, me, control, rights): Prepared<T>,
    blob: Vec<u8>,
) -> Result<Exchanged<T>> {
    let Heard { hello, nonces } = heard;
    let peer = hello.endpoint.ok_or_else(|| Error::Protocol("a Hello message without an endpoint".into()))?;
    // A control channel needs both sides: offer one only to a client that offered its own.
    let control = control.filter(|_| hello.control.is_some());
    let mut welcome = Message { control, rights, ..Message::new(Kind::Welcome, Some(me), blob) };
    if let Some((k, nc, ns)) = &nonces {
        welcome.mac = tag(mac(k, "server-welcome", nc, ns, Some(&welcome))?);
    }
    welcome.write_to(s).await?;
    let (peer_control, peer_grants) = (hello.control, hello.rights);
    Ok(Exchanged { prepared, me, peer, peer_control, peer_blob: hello.blob, peer_grants })
}

#[cfg(test)]
#[path = "auth_tests.rs"]
mod tests;
