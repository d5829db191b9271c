//! Work requests: scatter/gather entries, remote addresses, send-queue operations.

use rdma_sys as ffi;

use crate::error::{Error, Result};

/// A scatter/gather entry: `len` bytes at `addr`, inside a region with local key `lkey`.
/// Laid out exactly as `ibv_sge`, so slices of it are posted without copying.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Sge(ffi::ibv_sge);

impl Sge {
    /// A raw entry. Build it from a region ([`crate::verbs::Mr::sge`]) for a bounds-checked one.
    pub const fn new(addr: u64, len: u32, lkey: u32) -> Sge {
        Sge(ffi::ibv_sge { addr, length: len, lkey })
    }

    /// Start address.
    pub const fn addr(&self) -> u64 {
        self.0.addr
    }

    /// Length in bytes.
    pub const fn len(&self) -> u32 {
        self.0.length
    }

    /// Whether the entry is zero bytes long.
    pub const fn is_empty(&self) -> bool {
        self.0.length == 0
    }

    /// Local key.
    pub const fn lkey(&self) -> u32 {
        self.0.lkey
    }
}

impl PartialEq for Sge {
    fn eq(&self, other: &Sge) -> bool {
        (self.addr(), self.len(), self.lkey()) == (other.addr(), other.len(), other.lkey())
    }
}
impl Eq for Sge {}

impl std::fmt::Debug for Sge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sge({:#x}+{} lkey {:#x})", self.addr(), self.len(), self.lkey())
    }
}

/// A remote address and the key that grants access to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Virtual address in the peer's address space.
    pub addr: u64,
    /// The peer region's (or window's) remote key.
    pub rkey: u32,
}

impl RemoteAddr {
    /// `offset` bytes further.
    pub fn offset(self, offset: u64) -> RemoteAddr {
        RemoteAddr { addr: self.addr.wrapping_add(offset), rkey: self.rkey }
    }
}

/// What a send-queue work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// SEND: consumes a receive posted by the peer.
    Send,
    /// SEND with 32-bit immediate data.
    SendWithImm(u32),
    /// RDMA WRITE of the gathered bytes to the remote address.
    Write(RemoteAddr),
    /// RDMA WRITE that also delivers an immediate to the peer (consumes one of its receives).
    WriteWithImm(RemoteAddr, u32),
    /// RDMA READ from the remote address into the scatter list.
    Read(RemoteAddr),
    /// 64-bit fetch-and-add on an 8-byte-aligned remote word; the old value lands locally.
    FetchAdd {
        /// The remote word.
        remote: RemoteAddr,
        /// Value to add.
        add: u64,
    },
    /// Binds a type 2 memory window to `[addr, addr+len)` of region `mr` with `rkey`
    /// (see [`crate::verbs::Mw`]); no scatter/gather entries.
    BindMw {
        /// The window.
        mw: *mut ffi::ibv_mw,
        /// The rkey it gets (its index with a new tag: [`crate::verbs::Mw::next_rkey`]).
        rkey: u32,
        /// The region it opens a range of (registered with `MW_BIND`).
        mr: *mut ffi::ibv_mr,
        /// Start of the range.
        addr: u64,
        /// Length of the range.
        len: u64,
        /// What peers may do through it.
        access: u32,
    },
    /// Invalidates the window (or region) with this rkey: later remote accesses fail.
    LocalInvalidate(u32),
    /// 64-bit compare-and-swap on an 8-byte-aligned remote word; the old value lands locally.
    CompareSwap {
        /// The remote word.
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// Value stored when the word equals `compare`.
        swap: u64,
    },
}

/// What a work request does, without its operands: the name an operation has in errors and
/// logs, known before its operands are (a transfer checks its local buffer before it computes
/// the remote range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verb {
    /// [`SendOp::Send`].
    Send,
    /// [`SendOp::SendWithImm`].
    SendWithImm,
    /// [`SendOp::Write`].
    Write,
    /// [`SendOp::WriteWithImm`].
    WriteWithImm,
    /// [`SendOp::Read`].
    Read,
    /// [`SendOp::FetchAdd`].
    FetchAdd,
    /// [`SendOp::CompareSwap`].
    CompareSwap,
    /// [`SendOp::BindMw`].
    BindMw,
    /// [`SendOp::LocalInvalidate`].
    LocalInvalidate,
    /// A receive-queue request.
    Recv,
}

impl Verb {
    /// The operation's name, as errors print it ("RDMA WRITE", "receive", ...).
    pub const fn name(self) -> &'static str {
        match self {
            Verb::Send => "SEND",
            Verb::SendWithImm => "SEND with immediate",
            Verb::Write => "RDMA WRITE",
            Verb::WriteWithImm => "RDMA WRITE with immediate",
            Verb::Read => "RDMA READ",
            Verb::FetchAdd => "fetch-and-add",
            Verb::CompareSwap => "compare-and-swap",
            Verb::BindMw => "memory window bind",
            Verb::LocalInvalidate => "memory window invalidate",
            Verb::Recv => "receive",
        }
    }
}

impl std::fmt::Display for Verb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl SendOp {
    /// What this request does.
    pub const fn verb(&self) -> Verb {
        match self {
            SendOp::Send => Verb::Send,
            SendOp::SendWithImm(_) => Verb::SendWithImm,
            SendOp::Write(_) => Verb::Write,
            SendOp::WriteWithImm(..) => Verb::WriteWithImm,
            SendOp::Read(_) => Verb::Read,
            SendOp::FetchAdd { .. } => Verb::FetchAdd,
            SendOp::CompareSwap { .. } => Verb::CompareSwap,
            SendOp::BindMw { .. } => Verb::BindMw,
            SendOp::LocalInvalidate(_) => Verb::LocalInvalidate,
        }
    }

    /// The request's name, as errors print it.
    pub const fn name(&self) -> &'static str {
        self.verb().name()
    }
}

bitflags::bitflags! {
    /// Flags of a send-queue work request (`IBV_SEND_*`), combined with `|`; they print by name
    /// (`SendFlags(SIGNALED | INLINE)`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct SendFlags: u32 {
        /// Generate a completion.
        const SIGNALED = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        /// Wait for earlier READs/atomics before starting.
        const FENCE = ffi::ibv_send_flags::IBV_SEND_FENCE.0;
        /// Copy the payload into the WQE (up to the QP's max inline size); no lkey needed.
        const INLINE = ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        /// Ask the receiver's CQ to raise a solicited event.
        const SOLICITED = ffi::ibv_send_flags::IBV_SEND_SOLICITED.0;
    }
}

impl SendFlags {
    /// No flags: no completion unless the QP signals all (the empty set).
    pub const NONE: SendFlags = SendFlags::empty();
}

impl Default for SendFlags {
    /// [`SendFlags::NONE`].
    fn default() -> SendFlags {
        SendFlags::NONE
    }
}

/// One send-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Local memory to gather from (or scatter to, for READ and atomics).
    pub sges: &'a [Sge],
    /// The operation.
    pub op: SendOp,
    /// Flags.
    pub flags: SendFlags,
}

impl<'a> SendWr<'a> {
    /// A signaled request.
    pub fn new(wr_id: u64, sges: &'a [Sge], op: SendOp) -> SendWr<'a> {
        SendWr { wr_id, sges, op, flags: SendFlags::SIGNALED }
    }

    /// The same request with `flags` instead.
    pub fn flags(self, flags: SendFlags) -> SendWr<'a> {
        SendWr { flags, ..self }
    }

    /// Fills a raw `ibv_send_wr` (with `next` = NULL).
    pub(crate) fn raw(&self) -> ffi::ibv_send_wr {
        use ffi::ibv_wr_opcode::*;
        // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions of those); all-zero
        // is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = self.wr_id;
        wr.next = std::ptr::null_mut();
        // The provider only reads the list; ibv_post_send's signature is not const-correct.
        wr.sg_list = self.sges.as_ptr() as *mut ffi::ibv_sge;
        wr.num_sge = self.sges.len() as i32;
        wr.send_flags = self.flags.bits();
        let rdma = |r: RemoteAddr| ffi::wr_t { rdma: ffi::rdma_t { remote_addr: r.addr, rkey: r.rkey } };
        let atomic = |r: RemoteAddr, compare_add: u64, swap: u64| ffi::wr_t {
            atomic: ffi::atomic_t { remote_addr: r.addr, compare_add, swap, rkey: r.rkey },
        };
        match self.op {
            SendOp::Send => wr.opcode = IBV_WR_SEND,
            SendOp::SendWithImm(imm) => {
                wr.opcode = IBV_WR_SEND_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            SendOp::Write(r) => {
                wr.opcode = IBV_WR_RDMA_WRITE;
                wr.wr = rdma(r);
            }
            SendOp::WriteWithImm(r, imm) => {
                wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.wr = rdma(r);
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            SendOp::Read(r) => {
                wr.opcode = IBV_WR_RDMA_READ;
                wr.wr = rdma(r);
            }
            SendOp::FetchAdd { remote, add } => {
                wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
                wr.wr = atomic(remote, add, 0);
            }
            SendOp::CompareSwap { remote, compare, swap } => {
                wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
                wr.wr = atomic(remote, compare, swap);
            }
            SendOp::BindMw { mw, rkey, mr, addr, len, access } => {
                wr.opcode = IBV_WR_BIND_MW;
                wr.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
                    mw,
                    rkey,
                    bind_info: ffi::ibv_mw_bind_info { mr, addr, length: len, mw_access_flags: access },
                };
            }
            SendOp::LocalInvalidate(rkey) => {
                wr.opcode = IBV_WR_LOCAL_INV;
                wr.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
            }
        }
        wr
    }
}

/// Posts one receive request of `sges` through `post` (`ibv_post_recv` on a QP or
/// `ibv_post_srq_recv` on a shared queue, named by `verb`), after checking the SGE count
/// against `max_sge` of `queue`.
///
/// # Safety
/// `post` calls the verb on a live queue; the memory contract is the caller's (see
/// [`crate::verbs::Qp::post_recv`]).
pub(crate) unsafe fn post_one_recv(
    wr_id: u64,
    sges: &[Sge],
    max_sge: u32,
    queue: &str,
    verb: &'static str,
    post: impl FnOnce(*mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32,
) -> Result<()> {
    if sges.len() > max_sge as usize {
        return Err(Error::InvalidArgument(format!(
            "receive {wr_id} has {} SGEs; {queue} allows {max_sge}",
            sges.len()
        )));
    }
    let mut wr = ffi::ibv_recv_wr {
        wr_id,
        next: std::ptr::null_mut(),
        sg_list: sges.as_ptr() as *mut ffi::ibv_sge,
        num_sge: sges.len() as i32,
    };
    let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
    // The request and its SGE list outlive the call.
    let rc = post(&mut wr, &mut bad);
    if rc != 0 {
        return Err(Error::verbs(verb, rc));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sge_is_ibv_sge() {
        assert_eq!(std::mem::size_of::<Sge>(), std::mem::size_of::<ffi::ibv_sge>());
        let s = Sge::new(0x1000, 64, 7);
        assert_eq!((s.addr(), s.len(), s.lkey()), (0x1000, 64, 7));
    }

    #[test]
    fn raw_write_with_imm() {
        let sges = [Sge::new(0x1000, 8, 1)];
        let r = RemoteAddr { addr: 0x2000, rkey: 9 };
        let wr = SendWr::new(5, &sges, SendOp::WriteWithImm(r, 0xabcd)).raw();
        assert_eq!(wr.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(wr.num_sge, 1);
        assert_eq!(wr.send_flags, SendFlags::SIGNALED.bits());
        // SAFETY: the union was written as rdma / imm_data just above.
        unsafe {
            assert_eq!(wr.wr.rdma.remote_addr, 0x2000);
            assert_eq!(wr.wr.rdma.rkey, 9);
            assert_eq!(u32::from_be(wr.imm_data_invalidated_rkey_union.imm_data), 0xabcd);
        }
    }

    #[test]
    fn raw_compare_swap() {
        let sges = [Sge::new(0x1000, 8, 1)];
        let remote = RemoteAddr { addr: 0x3000, rkey: 4 };
        let wr = SendWr::new(1, &sges, SendOp::CompareSwap { remote, compare: 1, swap: 2 }).raw();
        assert_eq!(wr.opcode, ffi::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP);
        // SAFETY: the union was written as atomic just above.
        unsafe {
            assert_eq!((wr.wr.atomic.compare_add, wr.wr.atomic.swap, wr.wr.atomic.rkey), (1, 2, 4));
        }
    }
}
