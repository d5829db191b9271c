//! `Global`: the registered heap as the process allocator (`#[global_allocator]`).
//!
//! It keeps jemalloc's plain malloc/free fast path (automatic arenas, implicit thread caches)
//! and installs mralloc's extent hooks on every automatic arena before the first data
//! allocation, so every chunk the process allocates from is recorded (and, once
//! [`Global::bind`] is called, registered). What it took, each step found necessary by a failing
//! check:
//!
//! 1. one-time init on the first `alloc`, guarded by UNINIT→BUSY→READY; other threads wait; a
//!    re-entrant call from the initialising thread gets NULL; nothing here allocates;
//! 2. hooks on arenas `0..opt.narenas`, and `oversize_threshold:0` in jemalloc's `malloc_conf`
//!    so large requests never go to the default-hook huge arena — defined with the `global`
//!    feature, for every binary built with it (see `conf.rs`), together with the recommended
//!    `disable_large_size_classes:false`; [`Global`] checks at start-up that jemalloc runs with
//!    `oversize_threshold:0` (an environment variable may override it) and refuses otherwise;
//! 3. arena 0 already holds default-hook memory from jemalloc's own start-up: it is drained with
//!    leaked 4 KiB probes until one lands in a hooked chunk.
//!
//! The allocation fast path is tikv-jemallocator's, instruction for instruction (`malloc` when
//! the size class guarantees the alignment, as a tail call): its layout comparison reads the
//! alignment bound from the `Global` (`malloc_align`), which is 0 until the hooks are installed,
//! so it doubles as the readiness check; a chunk the hooks fail to make is reported by the hook.

use std::alloc::{GlobalAlloc, Layout};
use std::fmt::Write;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicUsize, Ordering};

use tikv_jemalloc_sys as je;

use crate::error::Result;
use crate::heap::bound;
use crate::heap::chunk;
use crate::heap::jemalloc;
use crate::heap::owner::Owner;
use crate::heap::stats::HeapStats;
use crate::verbs::{Access, Pd};

// jemalloc's start-up options: the scoped heaps' recommended ones and `oversize_threshold:0`,
// which Global needs (see the module docs). Defined only with feature `global`.
crate::malloc_conf!("oversize_threshold:0");

const UNINIT: u8 = 0;
const BUSY: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;

/// The one Global whose hooks are installed.
static INSTALLED: AtomicPtr<Global> = AtomicPtr::new(std::ptr::null_mut());
static INIT_TID: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// The registered heap as the process allocator.
///
/// ```no_run
/// #[global_allocator]
/// static A: mralloc::heap::Global = mralloc::heap::Global::new();
///
/// fn main() -> mralloc::Result<()> {
///     let v = vec![7u8; 1 << 20];                       // an ordinary Vec...
///     let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
///     A.bind(&pd)?;                                    // ...registered, with everything else
///     let keys = mralloc::keys_of(v.as_ptr()).expect("every heap pointer has keys");
///     println!("lkey {:#x}", keys.lkey);
///     Ok(())
/// }
/// ```
///
/// Unbound, it behaves as jemalloc, with one fixed cost: its hooks go on every automatic arena
/// at start-up (`opt.narenas`, four per CPU by default), where plain jemalloc sets an arena up
/// when a thread first needs it; each but arena 0 (whose metadata is jemalloc's own) costs a
/// 2 MiB metadata block of address space, about 90 KiB of it resident (measured with jemalloc
/// 5.3: 8 arenas, 0.5 MiB more than plain jemalloc on 2 CPUs; `_RJEM_MALLOC_CONF=narenas:N`
/// caps them). Metadata blocks are never registered. Data chunks are not excluded from `fork()` children (every
/// allocation of the process lives in them); on kernels with copy-on-fork for pinned pages
/// (Linux ≥ 5.13, as `rdma system show` reports) a fork copies the registered pages for the
/// child. On older kernels (or with rdma-core's fork support enabled) a bound `Global`'s pages
/// are shared copy-on-write with the child, and whichever process writes one first after the
/// fork gets a new page: if that is the parent, the NIC keeps the old one (see [`Global::bind`]).
pub struct Global {
    owner: Owner,
    state: AtomicU8,
    /// The largest alignment `alloc` hands to plain `malloc` (as tikv-jemallocator does when
    /// the size class guarantees it): 0 until the hooks are installed, so that every allocation
    /// takes the path that installs them (`ensure_init`); jemalloc's 16 once `state` is READY.
    /// The fast path's one layout comparison is then also its readiness check.
    malloc_align: AtomicUsize,
    /// `arena.N.retain_grow_limit` of every automatic arena.
    max_chunk: usize,
}

fn gettid() -> i64 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i64 }
}

/// Formats a mallctl name into a stack buffer (no allocation: this runs inside the allocator).
struct Name {
    buf: [u8; 64],
    len: usize,
}

impl Write for Name {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        if end >= self.buf.len() {
            return Err(std::fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

fn name(args: std::fmt::Arguments<'_>) -> Option<Name> {
    let mut n = Name { buf: [0; 64], len: 0 };
    n.write_fmt(args).ok()?;
    Some(n) // buf is zeroed, so it stays NUL-terminated
}

impl Name {
    /// The name with its NUL terminator (buf is zeroed past len).
    fn bytes(&self) -> &[u8] {
        &self.buf[..=self.len]
    }
}

/// Writes a mallctl value through tikv-jemalloc-ctl (no allocation). Returns whether it worked.
fn mallctl_write<T>(n: &Name, v: T) -> bool {
    // SAFETY: callers pass the type the named mallctl expects; the name is NUL-terminated.
    unsafe { tikv_jemalloc_ctl::raw::write(n.bytes(), v) }.is_ok()
}

/// Reads a mallctl value through tikv-jemalloc-ctl (no allocation).
fn mallctl_read<T: Copy>(n: &Name) -> Option<T> {
    // SAFETY: as above.
    unsafe { tikv_jemalloc_ctl::raw::read(n.bytes()) }.ok()
}

impl Global {
    /// A global allocator whose registrations allow local writes only: the NIC reads and
    /// writes process memory for this process's own operations; no peer can reach any of it.
    pub const fn new() -> Global {
        let mut owner = Owner::new_static(Access::LOCAL_WRITE);
        owner.idle_ms = std::sync::atomic::AtomicI64::new(crate::heap::idle::decay_ms(Some(
            crate::heap::idle::DEFAULT_IDLE_RELEASE,
        )));
        Global {
            owner,
            state: AtomicU8::new(UNINIT),
            malloc_align: AtomicUsize::new(0),
            max_chunk: crate::heap::DEFAULT_MAX_CHUNK,
        }
    }

    /// Largest chunk jemalloc grows an arena by (default 64 MiB, as for a scoped heap; at least
    /// 2 MiB). Larger allocations still get a chunk of their own size.
    ///
    /// ```
    /// #[global_allocator]
    /// static A: mralloc::heap::Global = mralloc::heap::Global::new().max_chunk(16 << 20).limit(8 << 30);
    /// # fn main() { let v = vec![1u8; 100]; assert_eq!(v[99], 1); }
    /// ```
    pub const fn max_chunk(self, bytes: usize) -> Global {
        let mut g = self;
        g.max_chunk = if bytes < crate::heap::pagemap::SLOT { crate::heap::pagemap::SLOT } else { bytes };
        g
    }

    /// Cap on mapped (and, once bound, registered and pinned) bytes. An allocation that would
    /// need more fails: `std::alloc::alloc` returns null, and infallible collections abort
    /// through `handle_alloc_error`, as with any exhausted allocator.
    pub const fn limit(self, bytes: usize) -> Global {
        let mut g = self;
        g.owner.limit = bytes;
        g
    }

    /// How long a chunk may stay unused before it is released (default
    /// [`crate::heap::DEFAULT_IDLE_RELEASE`], 10 s, jemalloc's own `dirty_decay_ms`; `None`:
    /// never), as for a scoped heap ([`crate::heap::HeapBuilder::idle_release`]): once bound, a
    /// released chunk is deregistered and its pages go back to the OS, and the next allocation
    /// jemalloc carves from it registers it again (on the allocating thread). Unbound, free
    /// memory loses its pages after the interval as with plain jemalloc (with `None`, never:
    /// jemalloc's decay is off altogether). jemalloc's metadata blocks (2 MiB for each automatic arena
    /// but arena 0: `Global` sets up all `opt.narenas` of them, four per CPU by default) are
    /// never released nor registered. Chunks are never
    /// released when the registrations carry remote rights
    /// ([`Global::with_remote_access_to_every_object`]).
    ///
    /// ```
    /// #[global_allocator]
    /// static A: mralloc::heap::Global = mralloc::heap::Global::new().idle_release(Some(std::time::Duration::from_secs(2)));
    /// # fn main() { let v = vec![1u8; 100]; assert_eq!(v[99], 1); }
    /// ```
    pub const fn idle_release(self, interval: Option<std::time::Duration>) -> Global {
        let mut g = self;
        g.owner.idle_ms = std::sync::atomic::AtomicI64::new(crate::heap::idle::decay_ms(interval));
        g
    }

    /// A global allocator whose registrations carry `remote` rights (plus local write) — an
    /// explicit, process-wide exposure: **every object of the process** (thread stacks' heap
    /// parts, thread caches, every `Box`, `Arc`, `String`, vtable-carrying object) lies in a
    /// chunk whose rkey, once handed to a peer with any buffer's address, lets that peer read
    /// and/or write the whole chunk for the rest of the process's life. Use it only between
    /// mutually trusted processes; to expose single buffers, use a scoped heap and
    /// [`crate::heap::Buffer::expose`] (or [`crate::heap::Buffer::remote`] for reading).
    ///
    /// # Safety
    /// With write or atomic rights, a peer holding such a key can change any object of the
    /// process — including pointers, vtables and bytes Rust code holds `&`/`&mut` references
    /// to — at any time, which is undefined behaviour for the local program unless the peer
    /// only ever touches memory the program treats as shared with the network (volatile or
    /// atomic access, no references). The caller guarantees that of every peer it hands a key
    /// or address to. Read-only rights leak data but cannot cause undefined behaviour locally.
    pub const unsafe fn with_remote_access_to_every_object(remote: Access) -> Global {
        let mut g = Global::new();
        g.owner.access = remote.union(Access::LOCAL_WRITE);
        g
    }

    /// Whether the hooks are installed (after the first allocation).
    pub fn is_ready(&self) -> bool {
        self.state.load(Ordering::Acquire) == READY
    }

    /// Debug builds: how many allocations and frees went through the global allocator while
    /// their thread held a heap's registration lock, which the extent hooks take too (such a
    /// call deadlocks when it reaches a hook). Always `Some(0)` unless that bug is back; `None`
    /// in release builds, which do not count. For tests.
    #[doc(hidden)]
    pub fn allocations_under_registration_lock() -> Option<u64> {
        bound::allocations_under_bound()
    }

    /// Registers every chunk allocated so far (memory from before `main` included) and every
    /// later one with `pd`.
    ///
    /// Takes `&'static self`: binding installs extent hooks that point into this value for the
    /// rest of the process, so a `Global` on the stack must not reach it.
    ///
    /// ```compile_fail,E0597
    /// # fn f(pd: &mralloc::verbs::Pd) -> mralloc::Result<()> {
    /// let local = mralloc::heap::Global::new();
    /// local.bind(pd)?; // error: `local` does not live long enough (bind needs 'static)
    /// # Ok(()) }
    /// ```
    ///
    /// # `fork()`
    ///
    /// A fork()ed child keeps allocating from `Global`, so its chunks are never kept out of
    /// children. Where the kernel copies pinned pages into a child (Linux 5.13+, rdma-core's
    /// `IBV_FORK_UNNEEDED`), the child gets copies and the parent keeps its registered pages.
    /// Where it does not (an older kernel, or rdma-core's fork support enabled by
    /// `ibv_fork_init` or `RDMAV_FORK_SAFE`, which would mark every registration
    /// `MADV_DONTFORK`: the chunks are marked `MADV_DOFORK` again after registering), a bound
    /// `Global`'s registered pages are shared copy-on-write with the child: whichever process
    /// writes a page first after the fork gets a new one, and if that is the parent, what it
    /// writes there from then on diverges from what the NIC reads and writes (the registration
    /// keeps the old page). Binding logs a warning in that case.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] if this `Global` is not the process allocator (or
    /// another one owns jemalloc's arenas); [`crate::Error::Registration`] if registering an
    /// existing chunk fails ([`crate::Error::Io`] if marking it `MADV_DOFORK` does);
    /// [`crate::Error::DeviceRemoved`] if `pd`'s device was removed (a binding whose device is
    /// removed later is dropped, as for [`crate::heap::Heap::bind`]).
    pub fn bind(&'static self, pd: &Pd) -> Result<()> {
        if !self.ensure_init() {
            return Err(crate::Error::InvalidArgument(
                "mralloc::heap::Global is not the process allocator (or another Global is)".into(),
            ));
        }
        self.owner.bind_static(pd)?;
        if !crate::fork::children_copy_pinned_pages() {
            tracing::warn!(
                "mralloc::heap::Global is bound where registered pages are not copied into fork() children (kernel before 5.13, or rdma-core's fork support enabled): after a fork, a parent's first write to a registered page moves it away from the page the NIC uses"
            );
        }
        // Registered memory is never purged (the hooks refuse); idle chunks are released
        // whole through the decommit hook after `dirty_decay_ms` (see `heap::idle`), with no
        // muzzy state: that also stops jemalloc's eager purge of every large free
        // (`oversize_threshold:0`), which would only reach refusing hooks once bound.
        self.set_decay(self.idle_ms(), -1);
        Ok(())
    }

    /// The idle interval as `dirty_decay_ms` (-1: off).
    fn idle_ms(&self) -> isize {
        self.owner.idle_ms.load(Ordering::Relaxed) as isize
    }

    /// Writes `dirty_decay_ms` and `muzzy_decay_ms` of every automatic arena (no allocation).
    fn set_decay(&self, dirty: isize, muzzy: isize) {
        let Some(narenas) = name(format_args!("opt.narenas")).and_then(|n| mallctl_read::<libc::c_uint>(&n)) else {
            return;
        };
        for i in 0..narenas {
            for (what, ms) in [("dirty_decay_ms", dirty), ("muzzy_decay_ms", muzzy)] {
                if let Some(n) = name(format_args!("arena.{i}.{what}")) {
                    mallctl_write(&n, ms);
                }
            }
        }
    }

    /// Chunk and registration statistics; `live_bytes` is jemalloc's `stats.allocated` (all
    /// automatic arenas, thread caches included).
    pub fn stats(&self) -> HeapStats {
        jemalloc::refresh_stats();
        let live = jemalloc::read::<usize>("stats.allocated").unwrap_or(0) as u64;
        HeapStats::from_owner(&self.owner, live, Some(live))
    }

    /// `alloc` / `alloc_zeroed` of a layout plain `malloc` does not serve (an alignment above
    /// 16 or above the size), or of any layout before the hooks are installed: installs them if
    /// needed (NULL if that fails, or on a re-entrant call from the installing thread), then
    /// `mallocx` with the alignment flag.
    ///
    /// # Safety
    /// `layout.size() > 0` (the callers' `GlobalAlloc` contract).
    #[inline(never)]
    unsafe fn alloc_other(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        if !self.ensure_init() {
            return std::ptr::null_mut();
        }
        let flags = jemalloc::align_flags(layout);
        // A zeroed request with 2 MiB alignment would reach the alloc hook with exactly the
        // arguments of jemalloc's metadata requests (see hooks.rs): zero those here instead.
        let zero_here = zeroed && layout.align() >= crate::heap::pagemap::SLOT;
        let zero_flag = if zeroed && !zero_here { je::MALLOCX_ZERO } else { 0 };
        // SAFETY: the hooks are installed; layout.size() > 0 (this function's contract).
        let p = unsafe { je::mallocx(layout.size(), flags | zero_flag) }.cast::<u8>();
        if zero_here && !p.is_null() {
            // SAFETY: a fresh allocation of layout.size() bytes.
            unsafe { p.write_bytes(0, layout.size()) };
        }
        p
    }

    #[inline]
    fn ensure_init(&self) -> bool {
        match self.state.load(Ordering::Acquire) {
            READY => true,
            _ => self.init_slow(),
        }
    }

    #[cold]
    fn init_slow(&self) -> bool {
        loop {
            match self.state.compare_exchange(UNINIT, BUSY, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(READY) => return true,
                Err(FAILED) => return false,
                Err(_) => {
                    if INIT_TID.load(Ordering::Acquire) == gettid() {
                        return false; // re-entrant call from the initialising thread
                    }
                    // SAFETY: sched_yield has no preconditions.
                    unsafe { libc::sched_yield() };
                }
            }
        }
        INIT_TID.store(gettid(), Ordering::Release);
        let ok = self.install();
        self.state.store(if ok { READY } else { FAILED }, Ordering::Release);
        if ok {
            // Opens the fast path: a thread that loads this (Acquire) sees the hooks installed.
            self.malloc_align.store(jemalloc::MIN_ALIGN, Ordering::Release);
        }
        ok
    }

    fn install(&self) -> bool {
        let me = self as *const Global as *mut Global;
        if INSTALLED.compare_exchange(std::ptr::null_mut(), me, Ordering::AcqRel, Ordering::Acquire).is_err() {
            crate::os::stderr_line(format_args!("mralloc::Global: another Global already owns jemalloc's arenas"));
            return false;
        }
        // Keep our malloc_conf definition linked in (and visible in a debugger).
        let _ = std::hint::black_box(&_rjem_malloc_conf);
        // Large requests above the threshold would go to jemalloc's huge arena, whose chunks
        // have no hooks (never registered): refuse to start rather than hand those out.
        let threshold = name(format_args!("opt.oversize_threshold")).and_then(|n| mallctl_read::<usize>(&n));
        if threshold != Some(0) {
            crate::os::stderr_line(format_args!(
                "mralloc::Global: jemalloc runs with oversize_threshold {threshold:?}, not 0 \
                 (was _RJEM_MALLOC_CONF or another _rjem_malloc_conf set?): Global needs it to be 0"
            ));
            return false;
        }
        if jemalloc::zeroes_everything() {
            crate::os::stderr_line(format_args!("mralloc::Global: {}", jemalloc::ZERO_REFUSED));
            return false;
        }
        let Some(narenas) = name(format_args!("opt.narenas")).and_then(|n| mallctl_read::<libc::c_uint>(&n)) else {
            return false;
        };
        let hooks = self.owner.hooks_ptr();
        for i in 0..narenas {
            let Some(n) = name(format_args!("arena.{i}.extent_hooks")) else { return false };
            if !mallctl_write(&n, hooks) {
                crate::os::stderr_line(format_args!("mralloc::Global: installing hooks on arena {i} failed"));
                return false;
            }
            if let Some(n) = name(format_args!("arena.{i}.retain_grow_limit")) {
                mallctl_write(&n, self.max_chunk);
            }
        }
        self.drain_arena0();
        // Unbound: the idle interval as dirty decay, muzzy as jemalloc's default (0) — or no
        // decay at all when idle release is off.
        let idle = self.idle_ms();
        self.set_decay(idle, if idle < 0 { -1 } else { 0 });
        true
    }

    /// Makes arena 0 hand out hooked memory only: its pre-existing default-hook pages are used
    /// up by leaked 4 KiB probes until one lands in a chunk our hook mapped.
    fn drain_arena0(&self) {
        let (Some(tc), Some(purge)) =
            (name(format_args!("thread.tcache.enabled")), name(format_args!("arena.0.purge")))
        else {
            return;
        };
        mallctl_write(&tc, false);
        // SAFETY: a command mallctl with no values.
        unsafe {
            je::mallctl(purge.buf.as_ptr().cast(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), 0)
        };
        let flags = je::MALLOCX_ARENA(0) | je::MALLOCX_TCACHE_NONE;
        for _ in 0..(64 << 20) / 4096 {
            // SAFETY: a plain allocation from arena 0; intentionally leaked.
            let p = unsafe { je::mallocx(4096, flags) };
            if p.is_null() {
                break;
            }
            if chunk::find(p as usize).is_some_and(|(_, r)| r.owner.load(Ordering::Relaxed) == self.owner.id) {
                break;
            }
        }
        mallctl_write(&tc, true);
    }
}

impl Default for Global {
    fn default() -> Global {
        Global::new()
    }
}

// SAFETY: allocations come from jemalloc (malloc/calloc/realloc when the size class guarantees
// the alignment, else mallocx/rallocx with the alignment flag; sdallocx with the flags derived
// from the layout exactly as jemalloc requires), always after the hooks are installed: plain
// `malloc` only once `malloc_align` is set (after READY), every other allocation through
// `ensure_init`. Sizes are never zero (GlobalAlloc contract).
unsafe impl GlobalAlloc for Global {
    /// tikv-jemallocator's path: one layout decision (which here also says the hooks are
    /// installed: see `malloc_align`), then jemalloc, as a tail call. The other layouts, and
    /// every call before the hooks are installed, go through an out-of-line function, so the
    /// fast path saves no registers. A failed chunk is reported by the hook
    /// (`report_chunk_failure`), so nothing looks at the result.
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bound::note_allocator_call();
        if layout.align() <= self.malloc_align.load(Ordering::Acquire) && layout.align() <= layout.size() {
            // SAFETY: the hooks are installed (malloc_align is set after READY); layout.size()
            // > 0 (GlobalAlloc contract).
            return unsafe { je::malloc(layout.size()) }.cast();
        }
        // SAFETY: layout.size() > 0 (GlobalAlloc contract).
        unsafe { self.alloc_other(layout, false) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bound::note_allocator_call();
        if layout.align() <= self.malloc_align.load(Ordering::Acquire) && layout.align() <= layout.size() {
            // SAFETY: as in alloc.
            return unsafe { je::calloc(1, layout.size()) }.cast();
        }
        // SAFETY: as in alloc.
        unsafe { self.alloc_other(layout, true) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        bound::note_allocator_call();
        // SAFETY: ptr came from this allocator with layout (GlobalAlloc contract).
        unsafe { je::sdallocx(ptr.cast(), layout.size(), jemalloc::align_flags(layout)) }
    }

    /// No readiness check: `ptr` came from this allocator, so the hooks are installed.
    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bound::note_allocator_call();
        let flags = jemalloc::flags_for(layout.align(), new_size);
        // SAFETY: ptr came from this allocator; new_size > 0 (GlobalAlloc contract).
        unsafe {
            if flags == 0 {
                je::realloc(ptr.cast(), new_size)
            } else {
                je::rallocx(ptr.cast(), new_size, flags)
            }
        }
        .cast()
    }
}
