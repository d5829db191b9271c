//! The async (tokio) front end of rail groups: the same transfers, as futures. A transfer's
//! future drives the one pipeline of [`Striped`] (cut, spread, repost, release): each poll
//! reaps what completed and posts what the windows allow, and it sleeps until a rail with a
//! slice in flight reaps a completion. Dropping the future (a cancelled task, a `select!`, a
//! `timeout`) parks the buffers until every slice in flight completed or was flushed.

use std::future::Future;
use std::net::SocketAddr;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::net::ToSocketAddrs;

use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::remote_desc::RemoteDesc;
use crate::transfer::front::aio::RailsLending;
use crate::transfer::rails::setup::{hello, join, joins, next_answer, parse_answer, pds_fit, rails_wanted, HELLO};
use crate::transfer::rails::{check_options, Finished, Link, RailInfo, RailOptions, Rails, Striped};
use crate::transfer::request::iobuf::{IoBuf, IoTarget};
use crate::transfer::RemoteLimits;
use crate::transfer::{AsyncConnection, AsyncListener};
use crate::verbs::Pd;

mod lending;

/// A rail group of async connections: [`Rails`]' transfers as futures, and remote memory lent
/// through every rail at once ([`AsyncRails::request_remote`], [`AsyncRails::push`]).
pub struct AsyncRails {
    rails: Rails,
    lending: Arc<RailsLending>,
}

impl std::fmt::Debug for AsyncRails {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncRails").field("rails", &self.rails.info()).finish()
    }
}

/// A striped transfer as a future: resolves to its [`Finished`] (the buffers, an outcome per
/// piece, a report per rail). Dropped early, it parks the buffers with the rails until every
/// slice in flight completed or was flushed.
#[must_use = "a transfer does nothing useful unless awaited; dropping it parks its buffers"]
pub struct StripedOp<B: Send + 'static> {
    state: Option<std::result::Result<Striped<B>, Finished<B>>>,
    /// Wakes the future when the oldest slice of a rail reaches its deadline (a rail that went
    /// silent raises no completion: `progress` fails it then).
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<B: Send + 'static> std::fmt::Debug for StripedOp<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.state {
            Some(Ok(s)) => s.fmt(f),
            Some(Err(_)) => f.write_str("StripedOp(refused)"),
            None => f.write_str("StripedOp(finished)"),
        }
    }
}

impl<B: Send + 'static> Unpin for StripedOp<B> {}

impl<B: Send + 'static> Future for StripedOp<B> {
    type Output = Finished<B>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Finished<B>> {
        let s = match self.state.as_mut().expect("a StripedOp polled after it finished") {
            Ok(s) => s,
            Err(_) => match self.state.take() {
                Some(Err(done)) => return Poll::Ready(done),
                _ => unreachable!("the state was a refusal"),
            },
        };
        if !s.progress() {
            // Register, then look once more: a completion reaped in between raised no wake-up.
            s.wake_on_completion(cx);
            if !s.progress() {
                if let Some(at) = s.expire_stalled() {
                    let at = tokio::time::Instant::from_std(at);
                    let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                    if timer.deadline() != at {
                        timer.as_mut().reset(at);
                    }
                    if timer.as_mut().poll(cx).is_ready() {
                        cx.waker().wake_by_ref();
                    }
                }
                return Poll::Pending;
            }
        }
        match self.state.take() {
            Some(Ok(s)) => Poll::Ready(s.finish()),
            _ => unreachable!("the state was a transfer"),
        }
    }
}

fn op<B: Send + 'static>(
    rails: &Rails,
    r: std::result::Result<Striped<B>, crate::transfer::Rejected<B>>,
) -> StripedOp<B> {
    StripedOp {
        timer: None,
        state: Some(r.map_err(|rej| match rej.buf {
            Some(buf) => Finished::refused(buf, rej.error, rails.group().blank_reports()),
            None => unreachable!("a refused striped transfer gives its buffer back"),
        })),
    }
}

impl AsyncRails {
    /// A group of async connections made any way, rail `i` being `conns[i]`.
    ///
    /// # Errors
    /// As [`Rails::new`].
    pub fn new(conns: Vec<AsyncConnection>, opts: RailOptions) -> Result<AsyncRails> {
        AsyncRails::new_serving(conns, opts, None)
    }

    /// As `new`, lending from `serving` from the start.
    fn new_serving(
        conns: Vec<AsyncConnection>,
        opts: RailOptions,
        serving: Option<(Heap, RemoteLimits)>,
    ) -> Result<AsyncRails> {
        let rails = Rails::from_links(conns.iter().cloned().map(Link::Async).collect(), opts)?;
        Ok(AsyncRails { rails, lending: RailsLending::new(&conns, serving) })
    }

    /// [`Rails::connect`], async: to a [`crate::transfer::RailsListener`] or an
    /// [`AsyncRailsListener`].
    ///
    /// # Errors
    /// As [`Rails::connect`] (each rail as [`AsyncConnection::connect_with`]).
    pub async fn connect(addr: impl ToSocketAddrs, pds: &[Pd], opts: RailOptions) -> Result<AsyncRails> {
        AsyncRails::connect_with(addr, pds, opts, &[]).await
    }

    /// [`Rails::connect_with`], async.
    ///
    /// # Errors
    /// As [`Rails::connect_with`].
    pub async fn connect_with(
        addr: impl ToSocketAddrs,
        pds: &[Pd],
        opts: RailOptions,
        blob: &[u8],
    ) -> Result<AsyncRails> {
        let n = pds_fit(pds)?;
        check_options(&opts)?;
        let first = AsyncConnection::connect_with(addr, &pds[0], opts.conn.clone(), &hello(n, blob)).await?;
        let (theirs, token, ports, blob_at) = parse_answer(first.peer_blob())?;
        let ip = first
            .peer_addr()
            .ok_or_else(|| Error::Protocol("rail group setup: rail 0 has no peer address".into()))?
            .ip();
        let mut conns = vec![first];
        for (i, port) in ports.iter().enumerate().take(usize::from(n).min(theirs) - 1) {
            let rail = i + 1;
            conns.push(
                AsyncConnection::connect_with((ip, *port), &pds[rail], opts.conn.clone(), &join(token, rail)).await?,
            );
        }
        let mut rails = AsyncRails::new(conns, opts)?;
        rails.rails.set_blob_at(blob_at);
        Ok(rails)
    }

    /// How many rails the group has (dead ones included).
    pub fn len(&self) -> usize {
        self.rails.len()
    }

    /// Always `false`: a group has at least one rail.
    pub fn is_empty(&self) -> bool {
        self.rails.is_empty()
    }

    /// Rail `i`'s connection.
    ///
    /// # Panics
    /// If `i >= self.len()`.
    pub fn rail(&self, i: usize) -> &AsyncConnection {
        match self.rails.group().rails()[i].link() {
            Link::Async(c) => c,
            Link::Blocking(_) => unreachable!("an AsyncRails holds async connections"),
        }
    }

    /// As [`Rails::info`].
    pub fn info(&self) -> Vec<RailInfo> {
        self.rails.info()
    }

    /// The options in force.
    pub fn options(&self) -> &RailOptions {
        self.rails.options()
    }

    /// As [`Rails::peer_blob`].
    pub fn peer_blob(&self) -> &[u8] {
        self.rails.peer_blob()
    }

    /// The rail messages go on: the first that lives (as [`Rails::messages`]). Send and
    /// receive there: `rails.messages()?.send(buf).await`.
    ///
    /// # Errors
    /// The first rail's failure if every rail failed.
    pub fn messages(&self) -> Result<&AsyncConnection> {
        let i = self.rails.messages_index()?;
        Ok(self.rail(i))
    }

    /// [`Rails::restore`] for an async group. As a live grant's key does, a live
    /// [`RailsRemoteMemory`](crate::transfer::RailsRemoteMemory) of this side with a key on rail
    /// `i` keeps it from being restored (the peer's key would be used on the new connection).
    ///
    /// # Errors
    /// As [`Rails::restore`]; [`Error::InvalidArgument`] (`conn` is dropped) while a handle of
    /// remote memory over the group has a key on rail `i`, or if the heap the group lends from
    /// ([`AsyncRails::serve_remote_memory`]) is not bound to `conn`'s PD.
    pub fn restore(&mut self, i: usize, conn: AsyncConnection) -> Result<()> {
        let rails = &mut self.rails;
        self.lending.restore(i, &conn, || rails.restore_link(i, Link::Async(conn.clone())))
    }

    /// [`Rails::post_write`] as a future. A refusal (as `post_write`'s) resolves at once, the
    /// buffer back in the [`Finished`] with the error as its piece's.
    pub fn write<B: IoBuf>(&self, buf: B, remote: &RemoteDesc, offset: u64) -> StripedOp<B> {
        op(&self.rails, self.rails.post_write(buf, remote, offset))
    }

    /// [`Rails::post_read`] as a future (refusals as [`AsyncRails::write`]'s).
    pub fn read<B: IoTarget>(&self, buf: B, remote: &RemoteDesc, offset: u64) -> StripedOp<B> {
        op(&self.rails, self.rails.post_read(buf, remote, offset))
    }

    /// [`Rails::post_write_list`] as a future.
    pub fn write_list<B: IoBuf>(&self, pieces: Vec<(B, RemoteDesc)>) -> StripedOp<B> {
        StripedOp { state: Some(Ok(self.rails.post_write_list(pieces))), timer: None }
    }

    /// [`Rails::post_read_list`] as a future.
    pub fn read_list<B: IoTarget>(&self, pieces: Vec<(B, RemoteDesc)>) -> StripedOp<B> {
        StripedOp { state: Some(Ok(self.rails.post_read_list(pieces))), timer: None }
    }
}

/// [`crate::transfer::RailsListener`], async.
pub struct AsyncRailsListener {
    listeners: Vec<AsyncListener>,
    pds: Vec<Pd>,
    opts: RailOptions,
    serving: Option<(Heap, RemoteLimits)>,
    one: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for AsyncRailsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncRailsListener").field("addr", &self.local_addr().ok()).finish()
    }
}

impl AsyncRailsListener {
    /// As [`crate::transfer::RailsListener::bind`].
    ///
    /// # Errors
    /// As [`crate::transfer::RailsListener::bind`] (each listener as [`AsyncListener::bind`]).
    pub async fn bind(addr: impl ToSocketAddrs, pds: &[Pd], opts: RailOptions) -> Result<AsyncRailsListener> {
        pds_fit(pds)?;
        check_options(&opts)?;
        let first = AsyncListener::bind(addr, &pds[0], opts.conn.clone()).await?;
        let ip = first.local_addr()?.ip();
        let mut listeners = vec![first];
        for pd in &pds[1..] {
            listeners.push(AsyncListener::bind((ip, 0), pd, opts.conn.clone()).await?);
        }
        Ok(AsyncRailsListener { listeners, pds: pds.to_vec(), opts, serving: None, one: tokio::sync::Mutex::new(()) })
    }

    /// Makes every group accepted from now on lend the peer memory of `heap` from the peer's
    /// first message on (as [`AsyncRails::serve_remote_memory`] on each group, without the race
    /// between the group's setup and that call).
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] if `heap` was not built with
    /// [`crate::verbs::Access::MW_BIND`] or is not bound to every device's PD; as
    /// [`Heap::alloc`] if the one-byte allocation that checks the binding fails.
    pub fn serve_remote_memory(&mut self, heap: &Heap, limits: RemoteLimits) -> Result<()> {
        for pd in &self.pds {
            crate::transfer::front::aio::check_lending_heap(heap, pd)?;
        }
        self.serving = Some((heap.clone(), limits));
        Ok(())
    }

    /// The address rail 0 listens on.
    ///
    /// # Errors
    /// As [`AsyncListener::local_addr`].
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listeners[0].local_addr()
    }

    /// Accepts the next rail group.
    ///
    /// # Errors
    /// As [`AsyncRailsListener::accept_with`].
    pub async fn accept(&self) -> Result<AsyncRails> {
        self.accept_with(&[]).await
    }

    /// As [`crate::transfer::RailsListener::accept_with`]. Cancel-safe between groups: a group
    /// half set up when the future is dropped is dropped with it.
    ///
    /// # Errors
    /// As [`crate::transfer::RailsListener::accept_with`].
    pub async fn accept_with(&self, blob: &[u8]) -> Result<AsyncRails> {
        let _one = self.one.lock().await;
        let limit = self.opts.conn.setup.connect_timeout;
        loop {
            let (token, answer) = next_answer(self.listeners[1..].iter().map(AsyncListener::local_addr), blob)?;
            let first = self.listeners[0].accept_with(&answer).await?;
            let Some(count) = rails_wanted(first.peer_blob(), first.peer_addr(), self.listeners.len()) else {
                continue;
            };
            match tokio::time::timeout(limit, self.take_rails(first, count, token)).await {
                Ok(Ok(conns)) => {
                    let mut rails = AsyncRails::new_serving(conns, self.opts.clone(), self.serving.clone())?;
                    rails.rails.set_blob_at(HELLO);
                    return Ok(rails);
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => tracing::debug!("rails: a group's later rails did not join within {limit:?}; dropped"),
            }
        }
    }

    async fn take_rails(&self, first: AsyncConnection, count: usize, token: u64) -> Result<Vec<AsyncConnection>> {
        let mut conns = vec![first];
        for rail in 1..count {
            loop {
                let c = self.listeners[rail].accept().await?;
                if joins(c.peer_blob(), token, rail) {
                    conns.push(c);
                    break;
                }
                tracing::debug!("rails: a connection on rail {rail}'s port without the group's token; dropped");
            }
        }
        Ok(conns)
    }
}
