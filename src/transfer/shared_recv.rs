//! `SharedReceiver`: one shared receive queue and a fixed set of receive buffers for every
//! connection of a server.

use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::transfer::request::received::{Arrival, Posted, Received};
use crate::transfer::Connection;
use crate::verbs::{Access, CompChannel, Cq, Pd, RegisteredBuf, Sge, Srq, WorkCompletion};

/// Receives for many connections from one pool: a shared receive queue (SRQ) with `slots`
/// receive buffers of `slot_size` bytes, registered once. Connections set up with it
/// ([`crate::transfer::Options::shared_receive`]) have no receive queue of their own, so a
/// server's receive memory is `slots × slot_size` whether it has 2 peers or 2 000; each message
/// says which connection it came from ([`SharedMessage::qp_num`], [`SharedMessage::is_from`]).
///
/// A message holds its buffer until it is dropped, then the buffer is posted again. When every
/// buffer is held or in use, senders wait (the NIC answers them receiver-not-ready and they
/// retry, as [`crate::transfer::QpOptions::rnr_retry`] says; mralloc's default retries forever).
/// Cheap to clone; the queue and its memory stay until the last clone, message and connection
/// using it are gone.
///
/// ```no_run
/// use mralloc::transfer::{Listener, Options, SharedReceiver};
/// # fn f(pd: &mralloc::verbs::Pd) -> mralloc::Result<()> {
/// let shared = SharedReceiver::new(pd, 256, 4096)?; // 1 MiB of receive memory, for every peer
/// let opts = Options { shared_receive: Some(shared.clone()), ..Options::default() };
/// let listener = Listener::bind("0.0.0.0:7471", pd, opts)?;
/// let conns: Vec<_> = (0..1000).map(|_| listener.accept()).collect::<Result<_, _>>()?;
/// let heap = mralloc::heap::Heap::new(pd)?;
/// loop {
///     let msg = shared.recv()?; // from any of the 1000
///     let Some(from) = conns.iter().find(|c| msg.is_from(c)) else { continue };
///     let mut echo = heap.alloc(msg.len())?;
///     echo.copy_from_slice(&msg);
///     drop(msg); // its buffer goes back to the queue
///     from.send(&echo)?;
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct SharedReceiver {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SharedReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiver")
            .field("slots", &self.inner.slots)
            .field("slot_size", &self.inner.slot_size)
            .field("posted", &self.inner.posted.load(Ordering::Relaxed))
            .finish()
    }
}

struct Inner {
    /// Taken in Drop: destroyed before `memory` is released (and `memory` leaked if that fails).
    srq: ManuallyDrop<Srq>,
    memory: ManuallyDrop<RegisteredBuf>,
    /// Where the receives complete (every attached connection's receive CQ).
    cq: Cq,
    channel: CompChannel,
    slots: u32,
    slot_size: usize,
    /// Receives posted and not yet completed.
    posted: AtomicU32,
    /// One thread polls and sleeps on the CQ at a time.
    polling: Mutex<()>,
    /// Failed receive completions (a connection that failed while a message was arriving).
    failed: AtomicU64,
    /// Keeps the device watched, for waits to end when it is removed.
    _removal: crate::verbs::removal::Subscription,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: both fields are taken once, here.
        let (srq, memory) = unsafe { (ManuallyDrop::take(&mut self.srq), ManuallyDrop::take(&mut self.memory)) };
        if self.cq.usable().is_err() {
            std::mem::forget((srq, memory)); // a fork()ed child's copy: the parent's
            return;
        }
        match srq.destroy() {
            Ok(()) => drop(memory),
            // The queue may still hold receives naming the memory: never release it.
            Err(e) => crate::verbs::keep_for_good(
                memory,
                format_args!("destroying a shared receive queue: {e}; leaking its receive memory"),
            ),
        }
    }
}

impl Inner {
    /// Posts slot `slot` again.
    fn post(&self, slot: u32) -> Result<()> {
        // Counted first: a completion reaped right after the post must not see it missing.
        self.posted.fetch_add(1, Ordering::Relaxed);
        let addr = self.memory.mr().addr() + slot as u64 * self.slot_size as u64;
        let sge = Sge::new(addr, self.slot_size as u32, self.memory.mr().lkey());
        // SAFETY: the slot lies inside `memory`, registered with LOCAL_WRITE in the queue's PD;
        // no message holds it (a message reposts its slot only when it is dropped, and nothing
        // reads the slot after that), and `memory` is released only after the queue is
        // destroyed (Drop).
        let r = unsafe { self.srq.post_recv(u64::from(slot), &[sge]) };
        if r.is_err() {
            self.posted.fetch_sub(1, Ordering::Relaxed);
        }
        r
    }
}

impl SharedReceiver {
    /// A shared receive queue in `pd` with `slots` buffers of `slot_size` bytes each, all
    /// posted. Messages longer than `slot_size` fail at the sender (and fail its connection).
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `slots` or `slot_size` is 0, `slot_size` is above 1 GiB,
    ///   or the memory would overflow.
    /// - [`Error::Verbs`] if creating the queue, its CQ or completion channel, registering the
    ///   memory or posting a receive fails (e.g. `slots` above the device's `max_srq_wr`).
    /// - [`Error::Io`] if mapping the memory fails.
    /// - [`Error::Io`] if the liveness thread cannot be started.
    /// - [`Error::Forked`] in a fork()ed child of the process that opened `pd`'s device.
    /// - [`Error::DeviceRemoved`] if `pd`'s device was removed.
    pub fn new(pd: &Pd, slots: u32, slot_size: usize) -> Result<SharedReceiver> {
        if slots == 0 || slot_size == 0 || slot_size > 1 << 30 {
            return Err(Error::InvalidArgument(format!(
                "a shared receiver needs 1 or more slots of 1 byte to 1 GiB (asked: {slots} of {slot_size})"
            )));
        }
        let bytes = (slots as usize)
            .checked_mul(slot_size)
            .ok_or_else(|| Error::InvalidArgument("shared receive memory overflows".into()))?;
        let srq = Srq::new(pd, slots, 1)?;
        let channel = CompChannel::new(pd.context())?;
        let cq = Cq::with_channel(pd.context(), srq.max_wr() + 1, &channel)?;
        let memory = RegisteredBuf::new(pd, bytes, Access::LOCAL_WRITE)?;
        let removal = crate::verbs::removal::watch(pd.context())?;
        let inner = Inner {
            srq: ManuallyDrop::new(srq),
            memory: ManuallyDrop::new(memory),
            cq,
            channel,
            slots,
            slot_size,
            posted: AtomicU32::new(0),
            polling: Mutex::new(()),
            failed: AtomicU64::new(0),
            _removal: removal,
        };
        for slot in 0..slots {
            inner.post(slot)?;
        }
        Ok(SharedReceiver { inner: Arc::new(inner) })
    }

    /// The next message from any connection using the queue; waits as long as it takes.
    ///
    /// # Errors
    /// - [`Error::Verbs`] if polling the CQ or waiting on its completion channel fails.
    /// - [`Error::Forked`] in a fork()ed child of the process that made the receiver.
    /// - [`Error::DeviceRemoved`] once the device was found removed and no message is left
    ///   (within a second of that; drop the receiver and its connections so that the kernel
    ///   can finish the removal).
    pub fn recv(&self) -> Result<SharedMessage> {
        self.next(None).map(|m| m.expect("no deadline"))
    }

    /// As [`SharedReceiver::recv`], giving up after `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] if no message arrived within `timeout`; otherwise as
    /// [`SharedReceiver::recv`].
    pub fn recv_timeout(&self, timeout: Duration) -> Result<SharedMessage> {
        self.next(Some(Instant::now() + timeout))?
            .ok_or(Error::Timeout(timeout, "a message on the shared receive queue"))
    }

    /// A message if one has arrived, without waiting.
    ///
    /// # Errors
    /// As [`SharedReceiver::recv`].
    pub fn try_recv(&self) -> Result<Option<SharedMessage>> {
        self.next(Some(Instant::now()))
    }

    /// Receive buffers (the most messages held or in flight at once).
    pub fn slots(&self) -> u32 {
        self.inner.slots
    }

    /// Bytes per receive buffer (the longest message).
    pub fn slot_size(&self) -> usize {
        self.inner.slot_size
    }

    /// The receive memory, `slots × slot_size`: all the receive memory of every connection
    /// using the queue.
    pub fn memory_bytes(&self) -> usize {
        self.inner.slots as usize * self.inner.slot_size
    }

    /// Receive buffers posted right now (the others are held by messages, or were lost to
    /// failed reposts).
    pub fn posted(&self) -> u32 {
        self.inner.posted.load(Ordering::Relaxed)
    }

    /// Receives that completed in error so far (a connection failing while a message for it
    /// was arriving); their buffers were posted again.
    pub fn failed_receives(&self) -> u64 {
        self.inner.failed.load(Ordering::Relaxed)
    }

    /// The queue connections are built with.
    pub(crate) fn srq(&self) -> &Srq {
        &self.inner.srq
    }

    /// The CQ their receives complete on.
    pub(crate) fn cq(&self) -> &Cq {
        &self.inner.cq
    }

    /// What an attached connection keeps alive until its QP is destroyed.
    pub(crate) fn keepalive(&self) -> impl Send + Sync + 'static {
        Arc::clone(&self.inner)
    }

    /// Waits until `deadline` (`None`: forever) for a successful receive.
    fn next(&self, deadline: Option<Instant>) -> Result<Option<SharedMessage>> {
        let inner = &self.inner;
        // Before the lock: in a fork()ed child a parent thread may hold it.
        inner.cq.usable()?;
        // Another receiver in `recv` does not make a deadline wait longer (try_recv: not at all).
        let _one = match deadline {
            Some(d) => match inner.polling.try_lock_until(d) {
                Some(g) => g,
                None => return Ok(None),
            },
            None => inner.polling.lock(),
        };
        let mut wc = [WorkCompletion::empty()];
        let mut armed = false;
        loop {
            if inner.cq.poll(&mut wc)? == 1 {
                if let Some(m) = self.take(&wc[0]) {
                    return Ok(Some(m));
                }
                continue;
            }
            if !armed {
                // Arm, then look once more: a completion that arrived before the arm raises
                // no event.
                inner.cq.arm()?;
                armed = true;
                continue;
            }
            // Nothing will arrive any more (a removal does not flush a shared queue).
            let ctx = &inner.cq.inner.ctx;
            if ctx.is_removed() {
                return Err(Error::DeviceRemoved { device: ctx.name().to_string() });
            }
            let wait = match deadline {
                None => Duration::from_secs(1),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    left.min(Duration::from_secs(1))
                }
            };
            inner.channel.wait(wait)?;
            armed = false; // an event disarms the CQ (after a timeout, arming again is harmless)
        }
    }

    /// A message from a completion; a failed one gives its buffer back to the queue.
    fn take(&self, wc: &WorkCompletion) -> Option<SharedMessage> {
        let inner = &self.inner;
        if wc.wr_id() >= u64::from(inner.slots) {
            // Not one of ours (the queue is crate-private, so this does not happen).
            tracing::error!(wr_id = wc.wr_id(), "a shared receive completion names no buffer; ignored");
            return None;
        }
        inner.posted.fetch_sub(1, Ordering::Relaxed);
        let slot = wc.wr_id() as u32;
        let got = if wc.is_ok() {
            Received::interpret(wc.opcode(), wc.byte_len(), wc.imm(), Posted::Recv(inner.slot_size)).ok()
        } else {
            None
        };
        let Some(got) = got else {
            inner.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(qp_num = wc.qp_num(), status = %wc.status().name(), "a shared receive failed");
            if let Err(e) = inner.post(slot) {
                tracing::error!("reposting a shared receive buffer: {e}; one buffer fewer");
            }
            return None;
        };
        Some(SharedMessage {
            inner: Arc::clone(inner),
            slot,
            len: got.len,
            qp_num: wc.qp_num(),
            imm: got.imm,
            kind: got.kind,
        })
    }
}

/// One message received through a [`SharedReceiver`]: its bytes (in the receiver's buffer,
/// which goes back to the queue when the message is dropped) and the connection it came from.
pub struct SharedMessage {
    inner: Arc<Inner>,
    slot: u32,
    len: usize,
    qp_num: u32,
    imm: Option<u32>,
    kind: Arrival,
}

impl std::fmt::Debug for SharedMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMessage")
            .field("qp_num", &self.qp_num)
            .field("len", &self.len)
            .field("imm", &self.imm)
            .field("kind", &self.kind)
            .finish()
    }
}

impl SharedMessage {
    /// The receiving queue pair's number: that of the connection the message came over
    /// (`conn.qp().qpn()`). QP numbers are reused once a connection is destroyed: a message
    /// held across its connection's drop may name a newer connection (drop a connection after
    /// handling what it sent).
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// Whether the message came over `conn`.
    pub fn is_from(&self, conn: &Connection) -> bool {
        conn.qp().qpn() == self.qp_num && conn.qp().srq().is_some_and(|s| s.as_raw() == self.inner.srq.as_raw())
    }

    /// The immediate value, if the peer sent one (SEND or WRITE with immediate).
    pub fn imm(&self) -> Option<u32> {
        self.imm
    }

    /// Which kind of message it was: a SEND's bytes, or only the immediate of the peer's WRITE
    /// with immediate (then the message has no bytes).
    pub fn kind(&self) -> Arrival {
        self.kind
    }
}

impl Deref for SharedMessage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let addr = self.inner.memory.mr().addr() as usize + self.slot as usize * self.inner.slot_size;
        // SAFETY: the slot lies inside the live registered memory; its receive completed and it
        // is not posted again until this message is dropped, so the NIC does not write it now;
        // `len` bytes were received into it.
        unsafe { std::slice::from_raw_parts(addr as *const u8, self.len) }
    }
}

impl Drop for SharedMessage {
    fn drop(&mut self) {
        if self.inner.cq.usable().is_err() {
            return; // a fork()ed child's copy: the queue is the parent's
        }
        if let Err(e) = self.inner.post(self.slot) {
            tracing::error!("reposting a shared receive buffer: {e}; one buffer fewer");
        }
    }
}
