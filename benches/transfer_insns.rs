//! User-space instructions per operation (issue 34, "Measure the layer's own cost"): a 64 B RDMA
//! WRITE, a 64 B SEND/RECV pair and a 64 B READ through each front end of mralloc's transfer
//! layer, and the same operations as a raw-verbs loop (rdma-sys `ibv_post_send` /
//! `ibv_post_recv` / `ibv_poll_cq` on QPs and CQs of its own, loopback on one device). Not a
//! criterion bench: `scripts/bench-transfer` runs it under valgrind's callgrind in the
//! Soft-RoCE VM with `--toggle-collect` on the `measured_*` functions and on the `outside_measure*`
//! ones (the second toggle turns collection off again inside the first), reads each measured
//! function's inclusive count and divides it by the operations it ran. Instruction counts,
//! unlike times, do not depend on TCG or on what else the machine does.
//!
//! ```text
//! transfer_insns FRONT... [--iters N] [--settle-us N]
//! ```
//! FRONT: `raw` (single requests, and chains of 16 as the baseline of `batch`), `blocking`
//! (`write`, `read`, `send` + `recv` on two threads), `pending` (`post_*` then `wait`), `batch`
//! (chains of 16 requests; receives through `post_recv`, which has no batch form), `async`
//! (`AsyncConnection` on a current-thread tokio runtime; feature `tokio`). Prints, per operation
//! and front end, `MEASURED <op> <front> <operations> <function>...` (the functions whose
//! inclusive counts add up to those operations), then `MISSES <n>`.
//!
//! **No spinning is counted.** The device context's `post_send` entry (what `ibv_post_send`
//! calls, for mralloc and the raw loop alike) is wrapped: after the provider's post it sleeps
//! `--settle-us` (default 2000 µs) in an `outside_measure*` function, so the completion is in the
//! CQ before anyone polls. The `poll_cq` entry is wrapped to count polls that found nothing
//! inside a measured function (`MISSES`): the run fails unless there are none, so every wait
//! counted claims its completion on its first poll. The wrappers' own few instructions (an
//! indirect call, a thread-local flag) are counted on both sides alike. For the blocking
//! SEND/RECV the receiving thread's `post_recv` entry also waits, uncounted, until the SEND has
//! been posted and settled (a blocking `recv` posts and waits in one call).
//!
//! Requests are built as mralloc builds them: 64 B WRITEs and SENDs inline (the default
//! `max_inline` of 64) for single requests; a `Batch` posts without inline, and so does the raw
//! chain it is compared with. Every request of the raw loop is built in the loop.

mod common;

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use mralloc::heap::{Buffer, Heap};
use mralloc::transfer::{Connection, Options, QpOptions};
use mralloc::verbs::{Access, ConnectOptions, Cq, Pd, Qp, QpCaps, RemoteAddr};
use mralloc::RemoteBuf;
use rdma_sys as ffi;

/// Bytes per operation.
const SIZE: usize = 64;
/// Requests per batch (`Batch` and the raw chains).
const BATCH: usize = 16;
/// Operations of each kind run before the measured ones (not counted).
const WARM: usize = 64;

const USAGE: &str = "\
usage: transfer_insns FRONT... [--iters N] [--settle-us N]

Instructions per 64 B WRITE, SEND/RECV pair and READ, for scripts/bench-transfer's callgrind
runs (--toggle-collect='*measured_*' --toggle-collect='*outside_measure*'), on the RDMA device
MRALLOC_DEVICE or the first active one.

fronts: raw blocking pending batch async (async: feature tokio)

options:
  --iters N      operations per measured loop (default 1000; batches: N rounded down to 16s)
  --settle-us N  sleep after each post, uncounted, so completions are there (default 2000)
  --bench        given by cargo bench: without MRALLOC_DEVICE or a front end, nothing runs
  --list         lists nothing and exits
  -h, --help     print this help
";

const FRONTS: &[&str] = &["raw", "blocking", "pending", "batch", "async"];

/// The provider's entries, wrapped: settle after every post, count empty polls.
mod hook {
    use super::*;
    use std::os::raw::c_int;

    type PostSend = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_send_wr, *mut *mut ffi::ibv_send_wr) -> c_int;
    type PostRecv = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> c_int;
    type PollCq = unsafe extern "C" fn(*mut ffi::ibv_cq, c_int, *mut ffi::ibv_wc) -> c_int;

    static POST_SEND: OnceLock<PostSend> = OnceLock::new();
    static POST_RECV: OnceLock<PostRecv> = OnceLock::new();
    static POLL_CQ: OnceLock<PollCq> = OnceLock::new();
    static SETTLE_US: AtomicU64 = AtomicU64::new(2000);
    /// Polls that found nothing while a thread was measuring.
    pub static MISSES: AtomicU64 = AtomicU64::new(0);

    thread_local! {
        /// This thread is inside (or about to enter) a measured function.
        static MEASURING: Cell<bool> = const { Cell::new(false) };
        /// This thread is the receiving side of the blocking SEND/RECV pair.
        static PEER: Cell<bool> = const { Cell::new(false) };
    }

    /// A counter threads wait on.
    pub struct Counter {
        n: Mutex<u64>,
        cv: Condvar,
    }

    impl Counter {
        const fn new() -> Counter {
            Counter { n: Mutex::new(0), cv: Condvar::new() }
        }
        pub fn get(&self) -> u64 {
            *self.n.lock().expect("counter lock")
        }
        fn bump(&self) {
            *self.n.lock().expect("counter lock") += 1;
            self.cv.notify_all();
        }
        pub fn wait_for(&self, v: u64) {
            let mut n = self.n.lock().expect("counter lock");
            while *n < v {
                n = self.cv.wait(n).expect("counter lock");
            }
        }
    }

    /// Send-queue posts settled (each bumped after its sleep).
    pub static SENT: Counter = Counter::new();
    /// Receives posted by the blocking pair's receiving thread.
    pub static POSTED: Counter = Counter::new();

    pub fn set_measuring(on: bool) {
        MEASURING.set(on);
    }

    pub fn set_peer(on: bool) {
        PEER.set(on);
    }

    /// Replaces the context's `post_send`, `post_recv` and `poll_cq` entries (those rdma-sys's
    /// `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` call) with the wrappers below.
    ///
    /// # Safety
    /// `ctx` is a live context, and no other thread uses it yet.
    pub unsafe fn install(ctx: *mut ffi::ibv_context, settle: Duration) {
        SETTLE_US.store(settle.as_micros() as u64, Relaxed);
        // SAFETY: the caller's contract: `ctx` is live and nobody reads its entries meanwhile;
        // the originals are kept before their slots are overwritten, once.
        unsafe {
            let ops = &mut (*ctx).ops;
            assert!(POST_SEND.set(ops.post_send.expect("a post_send entry")).is_ok(), "installed once");
            assert!(POST_RECV.set(ops.post_recv.expect("a post_recv entry")).is_ok(), "installed once");
            assert!(POLL_CQ.set(ops.poll_cq.expect("a poll_cq entry")).is_ok(), "installed once");
            ops.post_send = Some(post_send);
            ops.post_recv = Some(post_recv);
            ops.poll_cq = Some(poll_cq);
        }
    }

    unsafe extern "C" fn post_send(
        qp: *mut ffi::ibv_qp,
        wr: *mut ffi::ibv_send_wr,
        bad: *mut *mut ffi::ibv_send_wr,
    ) -> c_int {
        // SAFETY: the provider's own entry, with the caller's arguments (as ibv_post_send).
        let rc = unsafe { POST_SEND.get().expect("installed")(qp, wr, bad) };
        if MEASURING.get() {
            outside_measure_settle();
        } else {
            settle();
        }
        rc
    }

    unsafe extern "C" fn post_recv(
        qp: *mut ffi::ibv_qp,
        wr: *mut ffi::ibv_recv_wr,
        bad: *mut *mut ffi::ibv_recv_wr,
    ) -> c_int {
        // SAFETY: the provider's own entry, with the caller's arguments (as ibv_post_recv).
        let rc = unsafe { POST_RECV.get().expect("installed")(qp, wr, bad) };
        if PEER.get() {
            if MEASURING.get() {
                outside_measure_peer();
            } else {
                peer();
            }
        }
        rc
    }

    unsafe extern "C" fn poll_cq(cq: *mut ffi::ibv_cq, n: c_int, wc: *mut ffi::ibv_wc) -> c_int {
        // SAFETY: the provider's own entry, with the caller's arguments (as ibv_poll_cq).
        let got = unsafe { POLL_CQ.get().expect("installed")(cq, n, wc) };
        if got == 0 && MEASURING.get() {
            MISSES.fetch_add(1, Relaxed);
        }
        got
    }

    /// Gives the device time to finish what was just posted, then says so.
    fn settle() {
        std::thread::sleep(Duration::from_micros(SETTLE_US.load(Relaxed)));
        SENT.bump();
    }

    /// The blocking pair's receive was posted: tell the sender, and return once its SEND has
    /// been posted and settled (the receive's completion is then in the CQ).
    fn peer() {
        let want = SENT.get() + 1;
        POSTED.bump();
        SENT.wait_for(want);
    }

    /// [`settle`], not counted (callgrind toggles collection off inside).
    #[inline(never)]
    fn outside_measure_settle() {
        settle();
    }

    /// [`peer`], not counted.
    #[inline(never)]
    fn outside_measure_peer() {
        peer();
    }

    /// Waits until the pair's receiver has posted its `k`th receive (not counted).
    pub fn wait_posted(k: u64) {
        if MEASURING.get() {
            outside_measure_wait_posted(k);
        } else {
            POSTED.wait_for(k);
        }
    }

    #[inline(never)]
    fn outside_measure_wait_posted(k: u64) {
        POSTED.wait_for(k);
    }
}

/// What one measured loop ran: `ops` operations, counted in `functions`.
fn report(op: &str, front: &str, ops: usize, functions: &[&str]) {
    println!("MEASURED {op} {front} {ops} {}", functions.join(" "));
}

/// Runs `f` as a measured call: the thread-local flag the wrappers read is set around it.
fn measure<R>(f: impl FnOnce() -> R) -> R {
    hook::set_measuring(true);
    let r = f();
    hook::set_measuring(false);
    r
}

/// The shared setup: one device, one heap, the remote 64 B a WRITE writes and a READ reads.
struct Setup {
    pd: Pd,
    heap: Heap,
    remote: RemoteBuf,
    opts: Options,
    iters: usize,
}

impl Setup {
    /// The number of requests in whole batches of [`BATCH`].
    fn batched(&self) -> usize {
        (self.iters / BATCH).max(1) * BATCH
    }
}

mod raw {
    use super::*;

    /// Two connected QPs (`a` posts, `b` receives) with CQs of their own, and the memory.
    pub struct Raw {
        a: Qp,
        b: Qp,
        a_send: Cq,
        b_recv: Cq,
        src: Mem,
        back: Mem,
        rbufs: Mem,
        remote: RemoteAddr,
        wcs: Vec<ffi::ibv_wc>,
    }

    /// A registered buffer and its local key, looked up once (as a raw-verbs program keeps its
    /// region's `lkey`).
    struct Mem {
        buf: Buffer,
        lkey: u32,
    }

    impl Mem {
        fn new(buf: Buffer) -> Mem {
            let lkey = mralloc::keys_of(buf.as_ptr()).expect("a heap buffer").lkey;
            Mem { buf, lkey }
        }

        fn addr(&self) -> u64 {
            self.buf.as_ptr() as u64
        }
    }

    fn zeroed_wc() -> ffi::ibv_wc {
        // SAFETY: ibv_wc is plain old data; all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }

    fn zeroed_send_wr() -> ffi::ibv_send_wr {
        // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions of those); all-zero
        // is a valid value.
        unsafe { std::mem::zeroed() }
    }

    pub fn setup(s: &Setup) -> mralloc::Result<Raw> {
        let ctx = s.pd.context();
        let caps = QpCaps { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 64 };
        let mk = || -> mralloc::Result<(Qp, Cq, Cq)> {
            let (sc, rc) = (Cq::new(ctx, 264)?, Cq::new(ctx, 264)?);
            let qp = Qp::builder(&s.pd, &sc, &rc)
                .caps(caps)
                .remote_access(Access::REMOTE_WRITE | Access::REMOTE_READ)
                .build()?;
            Ok((qp, sc, rc))
        };
        let (a, a_send, _) = mk()?;
        let (b, _, b_recv) = mk()?;
        a.connect(&b.endpoint(), &ConnectOptions::default())?;
        b.connect(&a.endpoint(), &ConnectOptions::default())?;
        let mut src = s.heap.alloc(SIZE)?;
        src.fill(0x5a);
        Ok(Raw {
            a,
            b,
            a_send,
            b_recv,
            src: Mem::new(src),
            back: Mem::new(s.heap.alloc(SIZE * BATCH)?),
            rbufs: Mem::new(s.heap.alloc(SIZE * BATCH)?),
            remote: s.remote.at(0, SIZE as u64)?,
            wcs: (0..BATCH).map(|_| zeroed_wc()).collect(),
        })
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Op {
        Write,
        Read,
        Send,
    }

    impl Raw {
        /// One send-queue request on `len` bytes at `addr` (`lkey`), built as a raw-verbs
        /// program builds it.
        #[inline(always)]
        fn wr(&self, id: u64, op: Op, sge: &mut ffi::ibv_sge, flags: u32) -> ffi::ibv_send_wr {
            let mut wr = zeroed_send_wr();
            wr.wr_id = id;
            wr.sg_list = sge;
            wr.num_sge = 1;
            wr.send_flags = flags;
            wr.opcode = match op {
                Op::Write => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Op::Read => ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
                Op::Send => ffi::ibv_wr_opcode::IBV_WR_SEND,
            };
            if op != Op::Send {
                wr.wr = ffi::wr_t { rdma: ffi::rdma_t { remote_addr: self.remote.addr, rkey: self.remote.rkey } };
            }
            wr
        }

        /// Posts the send-queue chain starting at `wr` on `a`.
        ///
        /// # Safety
        /// `wr` starts a valid chain (each `next` null or the following request, alive for the
        /// call) whose SGEs name registered memory that stays valid and untouched until the
        /// chain's completion has been reaped.
        #[inline(always)]
        unsafe fn post(&self, wr: *mut ffi::ibv_send_wr) {
            let mut bad = std::ptr::null_mut();
            // SAFETY: the caller's contract; the QP is live (`self` holds it).
            let rc = unsafe { ffi::ibv_post_send(self.a.as_raw(), wr, &mut bad) };
            assert_eq!(rc, 0, "ibv_post_send");
        }

        /// Posts the receive chain starting at `wr` on `b`.
        ///
        /// # Safety
        /// As [`Raw::post`], for memory registered with local write.
        #[inline(always)]
        unsafe fn post_recv(&self, wr: *mut ffi::ibv_recv_wr) {
            let mut bad = std::ptr::null_mut();
            // SAFETY: the caller's contract; the QP is live (`self` holds it).
            let rc = unsafe { ffi::ibv_post_recv(self.b.as_raw(), wr, &mut bad) };
            assert_eq!(rc, 0, "ibv_post_recv");
        }

        /// Reaps `n` successful completions from `cq`.
        #[inline(always)]
        fn reap(cq: &Cq, wcs: &mut [ffi::ibv_wc], n: usize) {
            let mut got = 0;
            while got < n {
                // SAFETY: the CQ is live; `wcs[got..n]` are n - got writable ibv_wc slots.
                let k = unsafe { ffi::ibv_poll_cq(cq.as_raw(), (n - got) as i32, wcs.as_mut_ptr().add(got)) };
                assert!(k >= 0, "ibv_poll_cq");
                got += k as usize;
            }
            for wc in &wcs[..n] {
                assert_eq!(wc.status, ffi::ibv_wc_status::IBV_WC_SUCCESS, "a failed completion");
            }
        }

        /// `n` single requests of `op`, each posted (signaled; inline for a 64 B WRITE or SEND,
        /// as mralloc posts them) and its completion reaped; a SEND's receive is posted first
        /// and reaped after.
        fn single(&mut self, op: Op, n: usize) {
            let signaled = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            let inline = ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            let mut wcs = std::mem::take(&mut self.wcs);
            for i in 0..n as u64 {
                if op == Op::Send {
                    let mut rsge = ffi::ibv_sge { addr: self.rbufs.addr(), length: SIZE as u32, lkey: self.rbufs.lkey };
                    let mut rwr =
                        ffi::ibv_recv_wr { wr_id: i, next: std::ptr::null_mut(), sg_list: &mut rsge, num_sge: 1 };
                    // SAFETY: one receive into `rbufs` (held by `self`, untouched by the CPU),
                    // reaped below in this iteration.
                    unsafe { self.post_recv(&mut rwr) };
                }
                let (buf, flags) = match op {
                    Op::Read => (&self.back, signaled),
                    _ => (&self.src, signaled | inline),
                };
                let mut sge = ffi::ibv_sge { addr: buf.addr(), length: SIZE as u32, lkey: buf.lkey };
                let mut wr = self.wr(i, op, &mut sge, flags);
                // SAFETY: one request (next null) on `src` or `back` (held by `self`; a READ's
                // target untouched by the CPU), reaped below in this iteration.
                unsafe { self.post(&mut wr) };
                Raw::reap(&self.a_send, &mut wcs, 1);
                if op == Op::Send {
                    Raw::reap(&self.b_recv, &mut wcs, 1);
                }
            }
            self.wcs = wcs;
        }

        /// `n` requests of `op` in chains of [`BATCH`] (one post each, only the last signaled,
        /// no inline: as a `Batch` posts them); a SEND chain's receives are posted first as one
        /// chain and reaped after, [`BATCH`] per poll.
        fn chains(&mut self, op: Op, n: usize) {
            let signaled = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            let mut wcs = std::mem::take(&mut self.wcs);
            for c in 0..(n / BATCH) as u64 {
                let first = c * BATCH as u64;
                if op == Op::Send {
                    let (base, lk) = (self.rbufs.addr(), self.rbufs.lkey);
                    let mut rsges: [ffi::ibv_sge; BATCH] = std::array::from_fn(|k| ffi::ibv_sge {
                        addr: base + (k * SIZE) as u64,
                        length: SIZE as u32,
                        lkey: lk,
                    });
                    let mut rwrs: [ffi::ibv_recv_wr; BATCH] = std::array::from_fn(|k| ffi::ibv_recv_wr {
                        wr_id: first + k as u64,
                        next: std::ptr::null_mut(),
                        sg_list: &mut rsges[k],
                        num_sge: 1,
                    });
                    let chain = rwrs.as_mut_ptr();
                    for k in 0..BATCH - 1 {
                        // SAFETY: k + 1 < BATCH: both pointers are into the live array.
                        unsafe { (*chain.add(k)).next = chain.add(k + 1) };
                    }
                    // SAFETY: the chain just linked (its last `next` null), alive until the
                    // call returns; receives into `rbufs` (held by `self`), reaped below.
                    unsafe { self.post_recv(chain) };
                }
                let buf = if op == Op::Read { &self.back } else { &self.src };
                let (base, lk) = (buf.addr(), buf.lkey);
                // READ targets do not alias: one 64 B slice each; WRITEs and SENDs share the source.
                let step = if op == Op::Read { SIZE as u64 } else { 0 };
                let mut sges: [ffi::ibv_sge; BATCH] = std::array::from_fn(|k| ffi::ibv_sge {
                    addr: base + k as u64 * step,
                    length: SIZE as u32,
                    lkey: lk,
                });
                let mut wrs: [ffi::ibv_send_wr; BATCH] = std::array::from_fn(|_| zeroed_send_wr());
                for (k, sge) in sges.iter_mut().enumerate() {
                    let flags = if k == BATCH - 1 { signaled } else { 0 };
                    wrs[k] = self.wr(first + k as u64, op, sge, flags);
                }
                let chain = wrs.as_mut_ptr();
                for k in 0..BATCH - 1 {
                    // SAFETY: k + 1 < BATCH: both pointers are into the live array.
                    unsafe { (*chain.add(k)).next = chain.add(k + 1) };
                }
                // SAFETY: the chain just linked (its last `next` null, its SGEs in `sges`), alive
                // until the call returns; on `src` or `back` (held by `self`), reaped below.
                unsafe { self.post(chain) };
                Raw::reap(&self.a_send, &mut wcs, 1);
                if op == Op::Send {
                    Raw::reap(&self.b_recv, &mut wcs, BATCH);
                }
            }
            self.wcs = wcs;
        }
    }

    #[inline(never)]
    fn measured_write_raw(r: &mut Raw, n: usize) {
        r.single(Op::Write, n);
    }
    #[inline(never)]
    fn measured_sendrecv_raw(r: &mut Raw, n: usize) {
        r.single(Op::Send, n);
    }
    #[inline(never)]
    fn measured_read_raw(r: &mut Raw, n: usize) {
        r.single(Op::Read, n);
    }
    #[inline(never)]
    fn measured_write_raw_batch(r: &mut Raw, n: usize) {
        r.chains(Op::Write, n);
    }
    #[inline(never)]
    fn measured_sendrecv_raw_batch(r: &mut Raw, n: usize) {
        r.chains(Op::Send, n);
    }
    #[inline(never)]
    fn measured_read_raw_batch(r: &mut Raw, n: usize) {
        r.chains(Op::Read, n);
    }

    pub fn run(s: &Setup) -> mralloc::Result<()> {
        let mut r = setup(s)?;
        let n = s.iters;
        for (op, o) in [("write", Op::Write), ("sendrecv", Op::Send), ("read", Op::Read)] {
            r.single(o, WARM);
            measure(|| match o {
                Op::Write => measured_write_raw(&mut r, n),
                Op::Send => measured_sendrecv_raw(&mut r, n),
                Op::Read => measured_read_raw(&mut r, n),
            });
            report(op, "raw_verbs", n, &[format!("measured_{op}_raw").as_str()]);
        }
        let n = s.batched();
        for (op, o) in [("write", Op::Write), ("sendrecv", Op::Send), ("read", Op::Read)] {
            r.chains(o, WARM.div_ceil(BATCH) * BATCH);
            measure(|| match o {
                Op::Write => measured_write_raw_batch(&mut r, n),
                Op::Send => measured_sendrecv_raw_batch(&mut r, n),
                Op::Read => measured_read_raw_batch(&mut r, n),
            });
            report(op, "raw_verbs_batch", n, &[format!("measured_{op}_raw_batch").as_str()]);
        }
        Ok(())
    }
}

mod blocking {
    use super::*;

    fn write(x: &Connection, src: &Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        for _ in 0..n {
            x.write(src, remote, 0)?;
        }
        Ok(())
    }

    fn read(x: &Connection, back: &mut Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        for _ in 0..n {
            x.read(back, remote, 0)?;
        }
        Ok(())
    }

    /// The sending side of the pair: each SEND waits (uncounted) for the receiver's receive.
    fn send(x: &Connection, src: &Buffer, n: usize, posted: &mut u64) -> mralloc::Result<()> {
        for _ in 0..n {
            *posted += 1;
            hook::wait_posted(*posted);
            x.send(src)?;
        }
        Ok(())
    }

    fn recv(y: &Connection, rbuf: &mut Buffer, n: usize) -> mralloc::Result<()> {
        for _ in 0..n {
            y.recv(rbuf)?;
        }
        Ok(())
    }

    #[inline(never)]
    fn measured_write_blocking(x: &Connection, src: &Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        write(x, src, remote, n)
    }
    #[inline(never)]
    fn measured_read_blocking(x: &Connection, back: &mut Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        read(x, back, remote, n)
    }
    #[inline(never)]
    fn measured_sendrecv_blocking(x: &Connection, src: &Buffer, n: usize, posted: &mut u64) -> mralloc::Result<()> {
        send(x, src, n, posted)
    }
    #[inline(never)]
    fn measured_sendrecv_blocking_peer(y: &Connection, rbuf: &mut Buffer, n: usize) -> mralloc::Result<()> {
        recv(y, rbuf, n)
    }

    pub fn run(s: &Setup) -> mralloc::Result<()> {
        let (x, y) = Connection::pair(&s.pd, &s.opts)?;
        let n = s.iters;
        let mut src = s.heap.alloc(SIZE)?;
        src.fill(0x5a);
        let mut back = s.heap.alloc(SIZE)?;
        write(&x, &src, &s.remote, WARM)?;
        measure(|| measured_write_blocking(&x, &src, &s.remote, n))?;
        report("write", "blocking", n, &["measured_write_blocking"]);

        // SEND/RECV: `recv` posts and waits in one call, so the receiver is a thread of its own.
        let mut posted = hook::POSTED.get();
        std::thread::scope(|sc| -> mralloc::Result<()> {
            let peer = sc.spawn(|| -> mralloc::Result<()> {
                let mut rbuf = s.heap.alloc(SIZE)?;
                hook::set_peer(true);
                recv(&y, &mut rbuf, WARM)?;
                measure(|| measured_sendrecv_blocking_peer(&y, &mut rbuf, n))?;
                hook::set_peer(false);
                Ok(())
            });
            send(&x, &src, WARM, &mut posted)?;
            measure(|| measured_sendrecv_blocking(&x, &src, n, &mut posted))?;
            peer.join().expect("the receiving thread")
        })?;
        report("sendrecv", "blocking", n, &["measured_sendrecv_blocking", "measured_sendrecv_blocking_peer"]);

        read(&x, &mut back, &s.remote, WARM)?;
        measure(|| measured_read_blocking(&x, &mut back, &s.remote, n))?;
        report("read", "blocking", n, &["measured_read_blocking"]);
        Ok(())
    }
}

mod pending {
    use super::*;

    fn write(x: &Connection, mut buf: Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<Buffer> {
        for _ in 0..n {
            buf = x.post_write(buf, remote, 0)?.wait()?.0;
        }
        Ok(buf)
    }

    fn read(x: &Connection, mut buf: Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<Buffer> {
        for _ in 0..n {
            buf = x.post_read(buf, remote, 0)?.wait()?.0;
        }
        Ok(buf)
    }

    fn sendrecv(
        x: &Connection,
        y: &Connection,
        mut sbuf: Buffer,
        mut rbuf: Buffer,
        n: usize,
    ) -> mralloc::Result<(Buffer, Buffer)> {
        for _ in 0..n {
            let r = y.post_recv(rbuf)?;
            let s = x.post_send(sbuf)?;
            sbuf = s.wait()?.0;
            rbuf = r.wait()?.0;
        }
        Ok((sbuf, rbuf))
    }

    #[inline(never)]
    fn measured_write_pending(x: &Connection, buf: Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<Buffer> {
        write(x, buf, remote, n)
    }
    #[inline(never)]
    fn measured_read_pending(x: &Connection, buf: Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<Buffer> {
        read(x, buf, remote, n)
    }
    #[inline(never)]
    fn measured_sendrecv_pending(
        x: &Connection,
        y: &Connection,
        sbuf: Buffer,
        rbuf: Buffer,
        n: usize,
    ) -> mralloc::Result<(Buffer, Buffer)> {
        sendrecv(x, y, sbuf, rbuf, n)
    }

    pub fn run(s: &Setup) -> mralloc::Result<()> {
        let (x, y) = Connection::pair(&s.pd, &s.opts)?;
        let n = s.iters;
        let mut src = s.heap.alloc(SIZE)?;
        src.fill(0x5a);
        let src = write(&x, src, &s.remote, WARM)?;
        let src = measure(|| measured_write_pending(&x, src, &s.remote, n))?;
        report("write", "pending", n, &["measured_write_pending"]);
        let (src, rbuf) = sendrecv(&x, &y, src, s.heap.alloc(SIZE)?, WARM)?;
        let (_src, _rbuf) = measure(|| measured_sendrecv_pending(&x, &y, src, rbuf, n))?;
        report("sendrecv", "pending", n, &["measured_sendrecv_pending"]);
        let back = read(&x, s.heap.alloc(SIZE)?, &s.remote, WARM)?;
        let _back = measure(|| measured_read_pending(&x, back, &s.remote, n))?;
        report("read", "pending", n, &["measured_read_pending"]);
        Ok(())
    }
}

mod batch {
    use super::*;
    use mralloc::transfer::Pending;

    fn write(x: &Connection, src: &Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        for _ in 0..n / BATCH {
            let mut b = x.batch();
            for _ in 0..BATCH {
                b.write(src, remote, 0)?;
            }
            b.submit()?;
        }
        Ok(())
    }

    fn read(x: &Connection, back: &mut Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        for _ in 0..n / BATCH {
            let mut b = x.batch();
            for t in back.chunks_mut(SIZE) {
                b.read(t, remote, 0)?;
            }
            b.submit()?;
        }
        Ok(())
    }

    /// SENDs in batches; their receives through `post_recv` + `wait` (receives have no batch).
    fn sendrecv<'c>(
        x: &Connection,
        y: &'c Connection,
        src: &Buffer,
        rbufs: &mut Vec<Buffer>,
        pend: &mut Vec<Pending<'c, Buffer>>,
        n: usize,
    ) -> mralloc::Result<()> {
        for _ in 0..n / BATCH {
            for r in rbufs.drain(..) {
                pend.push(y.post_recv(r)?);
            }
            let mut b = x.batch();
            for _ in 0..BATCH {
                b.send(src)?;
            }
            b.submit()?;
            for p in pend.drain(..) {
                rbufs.push(p.wait()?.0);
            }
        }
        Ok(())
    }

    #[inline(never)]
    fn measured_write_batch(x: &Connection, src: &Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        write(x, src, remote, n)
    }
    #[inline(never)]
    fn measured_read_batch(x: &Connection, back: &mut Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<()> {
        read(x, back, remote, n)
    }
    #[inline(never)]
    fn measured_sendrecv_batch<'c>(
        x: &Connection,
        y: &'c Connection,
        src: &Buffer,
        rbufs: &mut Vec<Buffer>,
        pend: &mut Vec<Pending<'c, Buffer>>,
        n: usize,
    ) -> mralloc::Result<()> {
        sendrecv(x, y, src, rbufs, pend, n)
    }

    pub fn run(s: &Setup) -> mralloc::Result<()> {
        let (x, y) = Connection::pair(&s.pd, &s.opts)?;
        let n = s.batched();
        let warm = WARM.div_ceil(BATCH) * BATCH;
        let mut src = s.heap.alloc(SIZE)?;
        src.fill(0x5a);
        let mut back = s.heap.alloc(SIZE * BATCH)?;
        write(&x, &src, &s.remote, warm)?;
        measure(|| measured_write_batch(&x, &src, &s.remote, n))?;
        report("write", "batch", n, &["measured_write_batch"]);
        let mut rbufs = (0..BATCH).map(|_| s.heap.alloc(SIZE)).collect::<mralloc::Result<Vec<_>>>()?;
        let mut pend = Vec::with_capacity(BATCH);
        sendrecv(&x, &y, &src, &mut rbufs, &mut pend, warm)?;
        measure(|| measured_sendrecv_batch(&x, &y, &src, &mut rbufs, &mut pend, n))?;
        report("sendrecv", "batch", n, &["measured_sendrecv_batch"]);
        read(&x, &mut back, &s.remote, warm)?;
        measure(|| measured_read_batch(&x, &mut back, &s.remote, n))?;
        report("read", "batch", n, &["measured_read_batch"]);
        Ok(())
    }
}

#[cfg(feature = "tokio")]
mod asynchronous {
    use super::*;
    use mralloc::transfer::AsyncConnection;
    use tokio::runtime::Runtime;

    async fn write(x: &AsyncConnection, mut buf: Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<Buffer> {
        for _ in 0..n {
            buf = x.write(buf, remote, 0).await?;
        }
        Ok(buf)
    }

    async fn read(x: &AsyncConnection, mut buf: Buffer, remote: &RemoteBuf, n: usize) -> mralloc::Result<Buffer> {
        for _ in 0..n {
            buf = x.read(buf, remote, 0).await?;
        }
        Ok(buf)
    }

    async fn sendrecv(
        x: &AsyncConnection,
        y: &AsyncConnection,
        mut sbuf: Buffer,
        mut rbuf: Buffer,
        n: usize,
    ) -> mralloc::Result<(Buffer, Buffer)> {
        for _ in 0..n {
            // Both post when called: the receive first.
            let r = y.recv(rbuf);
            let s = x.send(sbuf);
            sbuf = s.await?;
            rbuf = r.await?.0;
        }
        Ok((sbuf, rbuf))
    }

    // Each measured function holds one `block_on` around its whole loop (its entry and exit
    // are counted once per loop, not per operation).
    #[inline(never)]
    fn measured_write_async(
        rt: &Runtime,
        x: &AsyncConnection,
        buf: Buffer,
        remote: &RemoteBuf,
        n: usize,
    ) -> mralloc::Result<Buffer> {
        rt.block_on(write(x, buf, remote, n))
    }
    #[inline(never)]
    fn measured_read_async(
        rt: &Runtime,
        x: &AsyncConnection,
        buf: Buffer,
        remote: &RemoteBuf,
        n: usize,
    ) -> mralloc::Result<Buffer> {
        rt.block_on(read(x, buf, remote, n))
    }
    #[inline(never)]
    fn measured_sendrecv_async(
        rt: &Runtime,
        x: &AsyncConnection,
        y: &AsyncConnection,
        sbuf: Buffer,
        rbuf: Buffer,
        n: usize,
    ) -> mralloc::Result<(Buffer, Buffer)> {
        rt.block_on(sendrecv(x, y, sbuf, rbuf, n))
    }

    pub fn run(s: &Setup) -> mralloc::Result<()> {
        // A current-thread runtime: the measured loop and the connections' driver tasks share
        // one thread, and an operation complete at its first poll never yields, so no other
        // task runs inside a measured loop (on a multi-threaded runtime the drivers would reap
        // on other threads whenever they woke, and the counts would vary with timing).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| mralloc::Error::Io { what: "building the tokio runtime".into(), source })?;
        let (x, y) = {
            let _in = rt.enter();
            AsyncConnection::pair(&s.pd, &s.opts)?
        };
        // Let the driver tasks start before anything is measured.
        rt.block_on(tokio::task::yield_now());
        let n = s.iters;
        let mut src = s.heap.alloc(SIZE)?;
        src.fill(0x5a);
        let src = rt.block_on(write(&x, src, &s.remote, WARM))?;
        let src = measure(|| measured_write_async(&rt, &x, src, &s.remote, n))?;
        report("write", "async", n, &["measured_write_async"]);
        let (src, rbuf) = rt.block_on(sendrecv(&x, &y, src, s.heap.alloc(SIZE)?, WARM))?;
        let (_src, _rbuf) = measure(|| measured_sendrecv_async(&rt, &x, &y, src, rbuf, n))?;
        report("sendrecv", "async", n, &["measured_sendrecv_async"]);
        let back = rt.block_on(read(&x, s.heap.alloc(SIZE)?, &s.remote, WARM))?;
        let _back = measure(|| measured_read_async(&rt, &x, back, &s.remote, n))?;
        report("read", "async", n, &["measured_read_async"]);
        // Dropped inside the runtime (their drop hands the QPs to its blocking pool).
        rt.block_on(async move {
            drop((x, y));
        });
        Ok(())
    }
}

fn main() -> mralloc::Result<()> {
    let mut iters = 1000usize;
    let mut settle_us = 2000u64;
    let cli = common::command_line(USAGE, FRONTS.len(), |name, p| {
        match name {
            "iters" => iters = common::positive(p, name)?,
            "settle-us" => settle_us = common::number(p, name)?,
            _ => return Ok(false),
        }
        Ok(true)
    });
    if cli.list {
        return Ok(());
    }
    if cli.bench && (cli.positional.is_empty() || std::env::var("MRALLOC_DEVICE").is_err()) {
        println!("transfer_insns: needs a front end and an RDMA device; run scripts/bench-transfer");
        return Ok(());
    }
    if cli.positional.is_empty() {
        common::usage_error(USAGE, "no front end given");
    }
    for f in &cli.positional {
        if !FRONTS.contains(&f.as_str()) {
            common::usage_error(USAGE, &format!("unknown front end {f}"));
        }
        if f == "async" && cfg!(not(feature = "tokio")) {
            common::usage_error(USAGE, "the async front end needs the tokio feature");
        }
    }
    let ctx = Options::default().open_device()?;
    // SAFETY: the context was just opened; nothing else uses it yet (no PD, QP or CQ exists).
    unsafe { hook::install(ctx.as_raw(), Duration::from_micros(settle_us)) };
    let pd = Pd::new(&ctx)?;
    let heap = Heap::builder().bind(&pd).access(Access::ALL_REMOTE).build()?;
    let dst = heap.alloc(SIZE)?.expose()?;
    let opts = Options {
        qp: QpOptions { remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ, ..Default::default() },
        ..Options::default()
    };
    let s = Setup { pd, heap, remote: dst.remote(), opts, iters };
    for f in &cli.positional {
        match f.as_str() {
            "raw" => raw::run(&s)?,
            "blocking" => blocking::run(&s)?,
            "pending" => pending::run(&s)?,
            "batch" => batch::run(&s)?,
            #[cfg(feature = "tokio")]
            "async" => asynchronous::run(&s)?,
            _ => unreachable!("checked above"),
        }
    }
    let misses = hook::MISSES.load(Relaxed);
    println!("MISSES {misses}");
    if misses > 0 {
        eprintln!(
            "transfer_insns: {misses} polls inside measured loops found no completion (spinning was counted): \
             raise --settle-us"
        );
        std::process::exit(1);
    }
    Ok(())
}
