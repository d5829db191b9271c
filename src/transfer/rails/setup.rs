//! Setting up a rail group in one call: rail 0 is an ordinary TCP setup (the secret
//! honoured) whose blobs carry the group's shape; each further rail is another, on a port the
//! listener names, tied to the group by a token.
//!
//! Blobs, version 1 (big-endian), each followed by the application's own blob:
//!
//! ```text
//! hello (client, rail 0):   "MRRL" | version u8 | rails u8
//! answer (listener, rail 0): "MRRL" | version u8 | rails u8 | token u64 | (rails - 1) x port u16
//! join (client, rail i):    "MRRL" | version u8 | token u64 | rail u8
//! ```
//!
//! The group has as many rails as the smaller side offers; rail `i` joins each side's `i`-th
//! protection domain's device.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::transfer::rails::{check_options, RailOptions, Rails, MAX_RAILS};
use crate::transfer::{Connection, Listener};
use crate::verbs::Pd;

const MAGIC: &[u8; 4] = b"MRRL";
const VERSION: u8 = 1;
pub(crate) const HELLO: usize = 6;

pub(crate) fn pds_fit(pds: &[Pd]) -> Result<u8> {
    match u8::try_from(pds.len()) {
        Ok(n) if (1..=MAX_RAILS).contains(&pds.len()) => Ok(n),
        _ => Err(Error::InvalidArgument(format!(
            "a rail group takes 1..={MAX_RAILS} protection domains, got {}",
            pds.len()
        ))),
    }
}

fn bad(what: &str) -> Error {
    Error::Protocol(format!("rail group setup: {what}"))
}

/// The header of a rails blob: magic and version checked; the rest after them.
fn header(b: &[u8]) -> Result<&[u8]> {
    match b.strip_prefix(MAGIC.as_slice()) {
        Some([VERSION, rest @ ..]) => Ok(rest),
        Some([v, ..]) => Err(bad(&format!("version {v}, this side speaks {VERSION}"))),
        _ => Err(bad("the peer is not setting up a rail group")),
    }
}

fn take<const N: usize>(b: &mut &[u8], what: &str) -> Result<[u8; N]> {
    if b.len() < N {
        return Err(bad(&format!("truncated {what}")));
    }
    let (head, rest) = b.split_at(N);
    *b = rest;
    Ok(head.try_into().expect("N bytes"))
}

/// The listener's answer: rails, token, ports of rails 1.., and where the application's blob
/// starts.
pub(crate) fn parse_answer(b: &[u8]) -> Result<(usize, u64, Vec<u16>, usize)> {
    let mut rest = header(b)?;
    let [rails] = take::<1>(&mut rest, "answer")?;
    if rails == 0 || usize::from(rails) > MAX_RAILS {
        return Err(bad(&format!("the listener offers {rails} rails")));
    }
    let token = u64::from_be_bytes(take::<8>(&mut rest, "answer")?);
    let ports = (1..rails).map(|_| take::<2>(&mut rest, "answer").map(u16::from_be_bytes)).collect::<Result<_>>()?;
    Ok((usize::from(rails), token, ports, b.len() - rest.len()))
}

/// The client's hello: its rail count, then the application's blob.
pub(crate) fn hello(rails: u8, blob: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HELLO + blob.len());
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&[VERSION, rails]);
    b.extend_from_slice(blob);
    b
}

/// The client's rail count in its hello (`None`: not a rail group's hello).
fn hello_rails(b: &[u8]) -> Option<usize> {
    let mut rest = header(b).ok()?;
    take::<1>(&mut rest, "hello").ok().map(|[n]| usize::from(n)).filter(|&n| n > 0)
}

/// The listener's answer: its rail count, the group's token, the ports of rails 1.., then the
/// application's blob.
fn answer(token: u64, ports: &[u16], blob: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(15 + 2 * ports.len() + blob.len());
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&[VERSION, ports.len() as u8 + 1]);
    b.extend_from_slice(&token.to_be_bytes());
    ports.iter().for_each(|p| b.extend_from_slice(&p.to_be_bytes()));
    b.extend_from_slice(blob);
    b
}

/// A later rail's join: the group's token and the rail's index.
pub(crate) fn join(token: u64, rail: usize) -> Vec<u8> {
    let mut b = MAGIC.to_vec();
    b.push(VERSION);
    b.extend_from_slice(&token.to_be_bytes());
    b.push(rail as u8);
    b
}

/// Whether `b` joins rail `rail` of the group `token`.
pub(crate) fn joins(b: &[u8], token: u64, rail: usize) -> bool {
    header(b).is_ok_and(|mut rest| {
        take::<8>(&mut rest, "join").is_ok_and(|t| u64::from_be_bytes(t) == token)
            && take::<1>(&mut rest, "join").is_ok_and(|[i]| usize::from(i) == rail)
            && rest.is_empty()
    })
}

impl Rails {
    /// Connects a rail group to a [`RailsListener`] (or an
    /// `AsyncRailsListener`, feature `tokio`) at `addr`: rail `i` in
    /// `pds[i]`, as many rails as the side with fewer protection domains has. Rails may share a
    /// PD (several rails over one device). Each rail is a TCP setup as
    /// [`Connection::connect`] makes, with `opts.conn` (its secret included); every rail's
    /// TCP goes to `addr`'s host (the RDMA traffic then goes over each rail's own devices), so
    /// that address must be reachable for the setup. Check [`Rails::len`]: a listener with
    /// fewer devices gives fewer rails.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] for no protection domains or more than [`MAX_RAILS`].
    /// - As [`Connection::connect_with`] for each rail (the first failure; the rails made are
    ///   closed).
    /// - [`Error::Protocol`] if the listener's answer is not a rail group's.
    pub fn connect(addr: impl ToSocketAddrs, pds: &[Pd], opts: RailOptions) -> Result<Rails> {
        Rails::connect_with(addr, pds, opts, &[])
    }

    /// [`Rails::connect`], sending `blob` to the listener with rail 0's setup
    /// ([`RailsListener::accept_with`] reads it as [`Rails::peer_blob`]).
    ///
    /// # Errors
    /// As [`Rails::connect`]; [`Error::InvalidArgument`] if `blob` is longer than
    /// [`crate::transfer::MAX_BLOB`] less 6 bytes.
    pub fn connect_with(addr: impl ToSocketAddrs, pds: &[Pd], opts: RailOptions, blob: &[u8]) -> Result<Rails> {
        let n = pds_fit(pds)?;
        check_options(&opts)?;
        let first = Connection::connect_with(addr, &pds[0], opts.conn.clone(), &hello(n, blob))?;
        let (theirs, token, ports, blob_at) = parse_answer(first.peer_blob())?;
        let ip = first.peer_addr().ok_or_else(|| bad("rail 0 has no peer address"))?.ip();
        let mut conns = vec![first];
        for (i, port) in ports.iter().enumerate().take(usize::from(n).min(theirs) - 1) {
            let rail = i + 1;
            conns.push(Connection::connect_with((ip, *port), &pds[rail], opts.conn.clone(), &join(token, rail))?);
        }
        let mut rails = Rails::new(conns, opts)?;
        rails.set_blob_at(blob_at);
        Ok(rails)
    }

    /// The application blob the peer sent with the group's setup (empty for a group made by
    /// [`Rails::new`]).
    pub fn peer_blob(&self) -> &[u8] {
        self.rail(0).peer_blob().get(self.blob_at()..).unwrap_or_default()
    }
}

/// Listens for rail groups: rail 0 on the address given, the others on ports of its choosing
/// (the same IP), named to each client in rail 0's setup.
pub struct RailsListener {
    listeners: Vec<Listener>,
    opts: RailOptions,
    /// One group sets up at a time (a group's later rails follow its first).
    one: Mutex<()>,
}

impl std::fmt::Debug for RailsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailsListener").field("listeners", &self.listeners).finish()
    }
}

impl RailsListener {
    /// Listens on `addr` for rail groups whose rail `i` uses `pds[i]` on this side.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no protection domains or more than [`MAX_RAILS`]; as
    /// [`Listener::bind`] for each rail's listener.
    pub fn bind(addr: impl ToSocketAddrs, pds: &[Pd], opts: RailOptions) -> Result<RailsListener> {
        pds_fit(pds)?;
        check_options(&opts)?;
        let first = Listener::bind(addr, &pds[0], opts.conn.clone())?;
        let ip = first.local_addr()?.ip();
        let mut listeners = vec![first];
        for pd in &pds[1..] {
            listeners.push(Listener::bind((ip, 0), pd, opts.conn.clone())?);
        }
        Ok(RailsListener { listeners, opts, one: Mutex::new(()) })
    }

    /// The address rail 0 listens on (the one clients connect to).
    ///
    /// # Errors
    /// As [`Listener::local_addr`].
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listeners[0].local_addr()
    }

    /// Accepts the next rail group.
    ///
    /// # Errors
    /// As [`RailsListener::accept_with`].
    pub fn accept(&self) -> Result<Rails> {
        self.accept_with(&[])
    }

    /// Accepts the next rail group, sending `blob` with rail 0's setup. A client that is not
    /// setting up a group, or whose later rails do not come within the options'
    /// `setup.connect_timeout`, is dropped and the call waits for the next one (as
    /// [`Listener::accept_with`] does for failed setups); a connection on a later rail's port
    /// that does not carry this group's token is dropped. Groups set up one at a time: a
    /// client that sets up rail 0 and then goes silent holds the others back for up to
    /// `connect_timeout` (set a [`crate::transfer::SetupOptions::secret`] to keep strangers
    /// from doing that).
    ///
    /// # Errors
    /// As [`Listener::accept_with`] for this side's own failures; [`Error::InvalidArgument`]
    /// if `blob` is too long.
    pub fn accept_with(&self, blob: &[u8]) -> Result<Rails> {
        let _one = self.one.lock();
        let limit = self.opts.conn.setup.connect_timeout;
        loop {
            let (token, answer) = next_answer(self.listeners[1..].iter().map(Listener::local_addr), blob)?;
            let first = self.listeners[0].accept_with(&answer)?;
            let Some(count) = rails_wanted(first.peer_blob(), first.peer_addr(), self.listeners.len()) else {
                continue;
            };
            match self.take_rails(first, count, token, limit) {
                Ok(conns) => {
                    let mut rails = Rails::new(conns, self.opts.clone())?;
                    rails.set_blob_at(HELLO);
                    return Ok(rails);
                }
                Err(e @ Error::Timeout(..)) => {
                    tracing::debug!("rails: a group's later rails did not join ({e}); dropped")
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the group's rails 1..count, each carrying `token` and its index, within `limit`.
    fn take_rails(&self, first: Connection, count: usize, token: u64, limit: Duration) -> Result<Vec<Connection>> {
        // A limit too far to add is no limit (`Duration::MAX`).
        let deadline = std::time::Instant::now().checked_add(limit);
        let mut conns = vec![first];
        for rail in 1..count {
            loop {
                let left = deadline.map_or(limit, |d| d.saturating_duration_since(std::time::Instant::now()));
                let c = self.listeners[rail].accept_within(&[], left)?;
                let joined = joins(c.peer_blob(), token, rail);
                if joined {
                    conns.push(c);
                    break;
                }
                tracing::debug!("rails: a connection on rail {rail}'s port without the group's token; dropped");
            }
        }
        Ok(conns)
    }
}

/// A fresh token and the answer that names it and the later rails' listeners (`addrs`), with
/// the application's `blob`: what the next group's rail 0 is accepted with.
///
/// # Errors
/// A listener's address, or the random bytes, cannot be had.
pub(crate) fn next_answer(addrs: impl Iterator<Item = Result<SocketAddr>>, blob: &[u8]) -> Result<(u64, Vec<u8>)> {
    let token = token()?;
    let ports = addrs.map(|a| a.map(|a| a.port())).collect::<Result<Vec<_>>>()?;
    Ok((token, answer(token, &ports, blob)))
}

/// How many of the `offered` rails the client that sent `hello` from `peer` gets (`None`, said
/// in a debug event: not a rail group's client, dropped).
pub(crate) fn rails_wanted(hello: &[u8], peer: Option<SocketAddr>, offered: usize) -> Option<usize> {
    let wanted = hello_rails(hello);
    if wanted.is_none() {
        tracing::debug!("rails: a client that is not setting up a rail group on {peer:?}; dropped");
    }
    wanted.map(|n| n.min(offered))
}

/// A fresh group token from the kernel's CSPRNG.
fn token() -> Result<u64> {
    let mut b = [0u8; 8];
    crate::os::fill_random(&mut b, "a rail group token")?;
    Ok(u64::from_ne_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_and_garbage_is_refused() {
        let a = answer(7, &[8000, 8001], b"app");
        let (rails, token, ports, at) = parse_answer(&a).unwrap();
        assert_eq!((rails, token, ports, &a[at..]), (3, 7, vec![8000, 8001], &b"app"[..]));
        for cut in 0..a.len() - 3 {
            assert!(parse_answer(&a[..cut]).is_err(), "{cut} bytes");
        }
        let mut v2 = a.clone();
        v2[4] = 2;
        assert!(matches!(parse_answer(&v2), Err(Error::Protocol(m)) if m.contains("version 2")));
        let mut none = a.clone();
        none[5] = 0;
        assert!(parse_answer(&none).is_err());
        let mut many = a;
        many[5] = 17;
        assert!(parse_answer(&many).is_err());
        assert!(pds_fit(&[]).is_err());
        assert_eq!(hello_rails(&hello(2, b"x")), Some(2));
        assert_eq!(hello_rails(&hello(0, b"")), None);
        assert_eq!(hello_rails(b"MRRX\x01\x02"), None);
        assert!(joins(&join(9, 1), 9, 1));
        assert!(!joins(&join(9, 1), 8, 1) && !joins(&join(9, 1), 9, 2) && !joins(&join(9, 1)[..13], 9, 1));
    }
}
