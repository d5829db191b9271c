//! The registered heap against a real device (Soft-RoCE in the VM). Run by `scripts/test`.

mod common;

use std::num::NonZeroU64;
use std::time::Duration;

use common::*;
use mralloc::heap::{chunk_of, nodes_of_pages, online_nodes, Buffer, Heap, NumaPolicy};
use mralloc::verbs::{Access, Pd, SendOp, SendWr};
use mralloc::Error;

/// Whether the kernel has transparent huge pages (`MADV_HUGEPAGE` is refused without).
fn thp_available() -> bool {
    std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists()
}

fn remote_heap(pd: &Pd) -> Heap {
    Heap::builder().bind(pd).access(Access::ALL_REMOTE).max_chunk(16 << 20).build().expect("bound heap")
}

fn filled(heap: &Heap, n: usize, seed: u64) -> Buffer {
    let mut b = heap.alloc(n).unwrap();
    b.copy_from_slice(&pattern(seed, n));
    b
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_heap_buffers_are_rdma_writable_and_readable_with_their_own_keys() {
    let lb = loopback();
    let heap = remote_heap(&lb.pd);
    // Sizes from 1 byte to above the 16 MiB max chunk, at odd offsets inside chunks.
    for (i, &n) in [1usize, 63, 4096, 65536, 1 << 20, 5 << 20, 20 << 20].iter().enumerate() {
        let _pad = heap.alloc(24 + i).unwrap();
        let src = filled(&heap, n, i as u64);
        let dst = heap.alloc(n).unwrap();
        let back = heap.alloc(n).unwrap();
        assert_eq!(heap.keys(dst.as_ptr()), heap.keys(dst.as_ptr().wrapping_add(n - 1)));
        write_read(&lb, &src, dst, &back, &format!("{n} bytes"));
    }
    // The purge hazard: free, ask jemalloc to purge and decay, reuse — still the NIC's pages.
    let freed: Vec<_> = (0..32).map(|i| filled(&heap, 256 << 10, 100 + i)).collect();
    drop(freed);
    heap.purge().unwrap();
    heap.decay().unwrap();
    for i in 0..32 {
        let src = filled(&heap, 256 << 10, 200 + i);
        let dst = heap.alloc(256 << 10).unwrap();
        let back = heap.alloc(256 << 10).unwrap();
        write_read(&lb, &src, dst, &back, &format!("reused after purge #{i}"));
    }
    let st = heap.stats();
    println!("heap stats after the sample: {st:?}");
    assert!(st.metadata_bytes > 0);
    assert_eq!(
        st.registered_bytes[0] + st.idle_bytes + st.metadata_bytes,
        st.mapped_bytes,
        "every data chunk but the idle ones is registered, no metadata block"
    );
    assert_eq!(st.registration_failures, 0);
    assert!(st.reg_mr_calls >= 1);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_late_bind_registers_existing_chunks() {
    let lb = loopback();
    let heap = Heap::builder().access(Access::ALL_REMOTE).build().unwrap();
    let early = filled(&heap, 300_000, 7);
    assert_eq!(early.lkey(), None);
    assert!(!vm_flags(early.as_ptr() as usize).iter().any(|f| f == "hg"), "unbound: no huge-page advice");
    heap.bind(&lb.pd).unwrap();
    assert!(early.lkey().is_some(), "bind registers chunks made before it");
    let st = heap.stats();
    assert!(st.metadata_bytes > 0);
    assert_eq!(
        st.registered_bytes[0] + st.idle_bytes + st.metadata_bytes,
        st.mapped_bytes,
        "bind registers every data chunk, no metadata block: {st:?}"
    );
    // Bound: huge pages pay (fewer pages to pin), for the chunks made before too.
    if thp_available() {
        let later = heap.alloc(4 << 20).unwrap();
        for (b, what) in [(&early, "early"), (&later, "later")] {
            let flags = vm_flags(b.as_ptr() as usize);
            assert!(
                flags.iter().any(|f| f == "hg"),
                "the {what} chunk of a bound heap has no huge-page advice: {flags:?}"
            );
        }
    }
    let dst = heap.alloc(300_000).unwrap();
    let back = heap.alloc(300_000).unwrap();
    write_read(&lb, &early, dst, &back, "late bind");
    assert_eq!(mralloc::keys_of(early.as_ptr()), early.keys());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_multi_pd_registration() {
    let ctx = open();
    let (pd1, pd2) = (Pd::new(&ctx).unwrap(), Pd::new(&ctx).unwrap());
    let heap = Heap::builder().bind(&pd1).bind(&pd2).access(Access::ALL_REMOTE).build().unwrap();
    let src = filled(&heap, 100_000, 9);
    let (k1, k2) = (src.keys_for(&pd1).unwrap(), src.keys_for(&pd2).unwrap());
    assert_ne!(k1.lkey, k2.lkey);
    assert_eq!(mralloc::keys_of_for(src.as_ptr(), &pd2), Some(k2));
    // Each PD's QPs move the buffer with that PD's keys.
    for pd in [&pd1, &pd2] {
        let lb = loopback_in(&ctx, pd);
        let dst = heap.alloc(100_000).unwrap().expose().unwrap();
        let keys = src.keys_for(pd).unwrap();
        let sge = [mralloc::verbs::Sge::new(src.addr(), 100_000, keys.lkey)];
        let remote = dst.remote_for(pd).unwrap().at(0, 100_000).unwrap();
        // SAFETY: buffers outlive the completion polled below.
        unsafe { lb.a.post_send(&[SendWr::new(3, &sge, SendOp::Write(remote))]).unwrap() };
        lb.cq_a.next(WAIT).unwrap().ok().unwrap();
        assert_bytes_eq(&dst.to_vec(), &src, "write through each PD");
    }
    assert_eq!(heap.stats().registered_bytes[0], heap.stats().registered_bytes[1]);
}

/// Set in the re-run of the fork tests under `RDMAV_FORK_SAFE=1`
/// ([`device_fork_tests_pass_with_rdma_cores_fork_support_on`]).
const FORK_SAFE_RUN: &str = "MRALLOC_FORK_SAFE_RUN";

/// Whether rdma-core marks registrations `MADV_DONTFORK` in this process (its fork support is
/// on): a fresh page registered with `pd` shows `dc` in /proc/self/smaps.
fn rdma_core_marks_registrations(pd: &Pd) -> bool {
    let page = 4096;
    // SAFETY: a fresh private anonymous page (not heap memory: no advice of mralloc's).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the page stays mapped until after the registration is gone.
    let mr =
        unsafe { mralloc::verbs::Mr::register(pd, p.cast(), page, Access::LOCAL_WRITE) }.expect("registering a page");
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let at = format!("{:x}-", p as usize);
    let flags = smaps
        .split('\n')
        .skip_while(|l| !l.starts_with(&at))
        .find_map(|l| l.strip_prefix("VmFlags:"))
        .expect("the page's VmFlags")
        .to_owned();
    mr.deregister().unwrap();
    // SAFETY: our page, no longer registered.
    unsafe { libc::munmap(p, page) };
    flags.split_whitespace().any(|w| w == "dc")
}

/// mralloc's decision for this process's children — copies of registered memory, or none (a
/// child touching it faults) — checked against what rdma-core does: where it marks
/// registrations `MADV_DONTFORK` (its fork support is on: `RDMAV_FORK_SAFE` with an rdma-core
/// from before 2024, whatever the kernel copies), children cannot get copies.
fn children_get_copies(pd: &Pd) -> bool {
    let copies = mralloc::fork_children_get_copies();
    let marks = rdma_core_marks_registrations(pd);
    println!(
        "fork: children get copies: {copies}; rdma-core marks registrations MADV_DONTFORK: {marks}; RDMAV_FORK_SAFE: {:?}",
        std::env::var("RDMAV_FORK_SAFE").ok()
    );
    assert!(!(copies && marks), "rdma-core keeps registered pages out of children: they get no copies");
    copies
}

/// Waits for `pid` (our child) and returns its status.
fn wait_for(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: pid is our child.
    let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(rc, pid, "waitpid: {}", std::io::Error::last_os_error());
    status
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_memory_written_after_fork_in_the_parent() {
    let lb = loopback();
    let heap = remote_heap(&lb.pd);
    let mut src = filled(&heap, 1 << 20, 11);
    let dst = heap.alloc(1 << 20).unwrap();
    let back = heap.alloc(1 << 20).unwrap();
    children_get_copies(&lb.pd);
    // SAFETY: the child only sleeps and _exits (async-signal-safe calls).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: async-signal-safe calls only.
        unsafe {
            libc::usleep(300_000);
            libc::_exit(0);
        }
    }
    // While the child runs, the parent writes the registered memory (copy-on-write would give
    // the parent a new page the NIC does not see; the kernel copies pinned pages for the child
    // at fork since Linux 5.13, and where it does not or rdma-core's fork support is on, the
    // memory is kept out of the child, MADV_DONTFORK). The child itself must survive the fork:
    // jemalloc's fork handlers touch the heap's arena, whose metadata the child must have.
    src.copy_from_slice(&pattern(12, 1 << 20));
    write_read(&lb, &src, dst, &back, "after fork");
    let status = wait_for(pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status:#x} (signal {})",
        if libc::WIFSIGNALED(status) { libc::WTERMSIG(status) } else { 0 }
    );
    if std::env::var_os(FORK_SAFE_RUN).is_some() {
        println!("fork after write child: OK");
    }
}

/// fork() with registered (pinned) heap memory holding typed values (a `Vec<NonZeroU64, Heap>`,
/// a `Box<u64, &Heap>`, the `String`s of a `hashbrown::HashMap` whose table is in the heap). As
/// mralloc decided for the process ([`children_get_copies`]): either the child reads its copies
/// of them as the parent had them (the kernel copies pinned pages into children, Linux 5.13+),
/// or it has none — each one sits in an inaccessible reservation, so nothing of the child's can
/// be mapped there and reading it faults cleanly (SIGSEGV) — never zero pages posing as values.
/// Either way the parent keeps its pages: what it writes afterwards is what the NIC reads.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_forked_child_reads_its_copies_of_registered_values_or_faults() {
    let lb = loopback();
    let heap = remote_heap(&lb.pd);
    let mut v: allocator_api2::vec::Vec<NonZeroU64, Heap> = allocator_api2::vec::Vec::new_in(heap.clone());
    v.extend((1..=100_000u64).map(|i| NonZeroU64::new(i * 7919).unwrap()));
    let b = allocator_api2::boxed::Box::new_in(0xdead_beef_u64, &heap);
    let mut map = hashbrown::HashMap::new_in(&heap);
    for i in 0..1000u64 {
        map.insert(i, format!("{i:08}"));
    }
    let table = map.iter().next().unwrap().1 as *const String as *const u8;
    let values = [v.as_ptr().cast::<u8>(), (&*b as *const u64).cast(), table];
    for p in values {
        assert!(heap.keys(p).is_some(), "{p:?} is not registered");
    }
    if children_get_copies(&lb.pd) {
        // SAFETY: the child makes no allocation and takes no lock: it reads memory, then _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let raw = v.as_ptr().cast::<u64>();
            // SAFETY: v.len() initialised elements read as plain u64s (sound whatever they hold).
            let code = if (0..v.len()).any(|i| unsafe { raw.add(i).read_volatile() } != (i as u64 + 1) * 7919) {
                1
            // SAFETY: as above, one u64.
            } else if unsafe { (&*b as *const u64).read_volatile() } != 0xdead_beef {
                2
            } else if !v.iter().zip(1u64..).all(|(x, i)| x.get() == i * 7919) || *b != 0xdead_beef {
                3
            } else if map.len() != 1000
                || !(0..1000u64).all(|i| map.get(&i).is_some_and(|s| s.as_bytes() == eight_digits(i)))
            {
                4
            } else {
                0
            };
            // SAFETY: leaves the child without running the parent's destructors or the harness.
            unsafe { libc::_exit(code) };
        }
        let status = wait_for(pid);
        assert!(libc::WIFEXITED(status), "child status {status:#x} (signal {})", libc::WTERMSIG(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "child check {} failed", libc::WEXITSTATUS(status));
    } else {
        for (what, p) in ["the Vec's elements", "the Box's value", "the map's table"].into_iter().zip(values) {
            // SAFETY: the child makes system calls and one read (no allocation, no lock), then
            // _exits if the read did not fault.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                // SAFETY: sysconf has no preconditions.
                let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
                let page = p as usize & !(size - 1);
                // SAFETY: a mapping exactly there, refused if anything (a reservation) is there.
                let q = unsafe {
                    libc::mmap(
                        page as *mut libc::c_void,
                        size,
                        libc::PROT_READ,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                        -1,
                        0,
                    )
                };
                // SAFETY: as above, then a read that must fault.
                unsafe {
                    if q as usize == page {
                        libc::_exit(5); // a plain hole: the child could map zeros over the value
                    }
                    std::ptr::read_volatile(p);
                    libc::_exit(6);
                }
            }
            let status = wait_for(pid);
            assert!(
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
                "{what}: a child with no copies must fault cleanly reading it; status {status:#x} (exit code {}: 5 = no reservation, 6 = read something)",
                if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -1 }
            );
        }
    }
    // The parent's pages are still the NIC's: new values, RDMA-WRITten from the Vec's memory.
    for (x, i) in v.iter_mut().zip(1u64..) {
        *x = NonZeroU64::new(i * 31).unwrap();
    }
    let n = 64 << 10;
    // SAFETY: n bytes of the Vec's initialised elements.
    let src = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), n) };
    let lkey = heap.keys(src.as_ptr()).unwrap().lkey;
    let dst = heap.alloc(n).unwrap().expose().expect("dst exposed");
    let sge = [mralloc::verbs::Sge::new(src.as_ptr() as u64, n as u32, lkey)];
    // SAFETY: the Vec and dst outlive the completion polled right after; nothing writes them.
    unsafe { lb.a.post_send(&[SendWr::new(1, &sge, SendOp::Write(dst.remote().at(0, n as u64).unwrap()))]).unwrap() };
    lb.cq_a.next(WAIT).unwrap().ok().unwrap();
    assert_bytes_eq(&dst.to_vec(), src, "the parent's values after the fork, as the NIC reads them");
    if std::env::var_os(FORK_SAFE_RUN).is_some() {
        println!("fork values child: OK");
    }
}

/// The fork tests once more in a process with `RDMAV_FORK_SAFE=1`, where rdma-core's fork
/// support marks every registration `MADV_DONTFORK` (rdma-core from before 2024, such as the
/// VM's v44, even though the kernel copies pinned pages): mralloc must then keep registered
/// data out of children (reservations) and still give them jemalloc's metadata, or a child
/// crashes in jemalloc's fork handler.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_fork_tests_pass_with_rdma_cores_fork_support_on() {
    const TESTS: [&str; 2] = [
        "device_memory_written_after_fork_in_the_parent",
        "device_a_forked_child_reads_its_copies_of_registered_values_or_faults",
    ];
    let child = std::process::Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .args(TESTS)
        .envs([(FORK_SAFE_RUN, "1"), ("RDMAV_FORK_SAFE", "1")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning the RDMAV_FORK_SAFE=1 run");
    let text = finish_child(child, "RDMAV_FORK_SAFE=1 run");
    assert!(
        text.contains("fork after write child: OK") && text.contains("fork values child: OK"),
        "both fork tests ran in the RDMAV_FORK_SAFE=1 process"
    );
}

/// `i` as eight decimal digits (what `format!("{i:08}")` gives), without allocating.
fn eight_digits(mut i: u64) -> [u8; 8] {
    let mut d = [b'0'; 8];
    for c in d.iter_mut().rev() {
        *c = b'0' + (i % 10) as u8;
        i /= 10;
    }
    d
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_churn_keeps_registered_bytes_bounded() {
    let lb = loopback();
    let heap = Heap::builder().bind(&lb.pd).build().unwrap();
    let (peak, mapped) = churn(&heap, 20_000, 64, 3 << 20);
    let st = heap.stats();
    let registered = st.registered_bytes[0];
    let bound = 2 * peak + mralloc::heap::DEFAULT_MAX_CHUNK as u64;
    println!(
        "churn (VM, bound to {}): peak live {peak} B, registered {registered} B, bound {bound} B, ratio {:.2}, {} chunks, {} reg_mr calls in {:?}",
        lb.ctx.name(),
        registered as f64 / peak as f64,
        st.chunks,
        st.reg_mr_calls,
        st.reg_mr_time
    );
    assert_eq!(
        registered + st.idle_bytes + st.metadata_bytes,
        mapped,
        "every data chunk but the idle ones is registered"
    );
    assert!(registered <= bound, "registered {registered} > 2 x peak {peak} + max chunk");
}

/// The device side of the model: late binds to more PDs between operations, and the NIC reads
/// every zero-filled buffer (reused memory included) by DMA.
struct DeviceEnv<'a> {
    lb: &'a Loopback,
    heap: &'a Heap,
    nic: std::sync::Mutex<()>,
    extra_pds: std::sync::Mutex<Vec<Pd>>,
}

impl model::Env for DeviceEnv<'_> {
    fn maintain(&self, heap: &Heap, which: u8) {
        match which % 3 {
            0 => heap.purge().expect("purge"),
            1 => heap.decay().expect("decay"),
            _ => {
                let mut pds = self.extra_pds.lock().unwrap();
                if pds.len() < 2 {
                    let pd = Pd::new(&self.lb.ctx).unwrap();
                    heap.bind(&pd).expect("late bind while the other thread allocates");
                    pds.push(pd);
                }
            }
        }
    }

    fn check_zeroed(&self, buf: &Buffer) {
        let n = buf.len();
        let got = {
            let _one_at_a_time = self.nic.lock().unwrap();
            // SAFETY: `buf` is live for its n bytes throughout.
            unsafe { nic_read(self.lb, self.heap, buf.as_ptr(), n) }
        };
        let dirty = got.iter().filter(|&&x| x != 0).count();
        assert_eq!(dirty, 0, "the NIC read {dirty} non-zero bytes of a fresh {n}-byte buffer");
    }
}

/// What the NIC reads of the `n` heap bytes at `ptr` (with their chunk's lkey, as the source of
/// an RDMA WRITE into a buffer of its own, prefilled with 0xFF and exposed on its own).
///
/// # Safety
/// `ptr` must be live for `n` bytes of `heap` until this returns.
unsafe fn nic_read(lb: &Loopback, heap: &Heap, ptr: *const u8, n: usize) -> Vec<u8> {
    let keys = heap.keys(ptr).expect("bound heap gives keys");
    let mut back = heap.alloc(n).unwrap();
    back.fill(0xFF);
    let back = back.expose().unwrap();
    let sge = [mralloc::verbs::Sge::new(ptr as u64, n as u32, keys.lkey)];
    let remote = back.remote().at(0, n as u64).unwrap();
    // SAFETY: `ptr` (the caller's promise) and `back` live until the completion below is polled.
    unsafe { lb.a.post_send(&[SendWr::new(4, &sge, SendOp::Write(remote))]).unwrap() };
    lb.cq_a.next(WAIT).unwrap().ok().unwrap();
    back.to_vec()
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_bound_heap_matches_model() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let lb = loopback();
    let heap = remote_heap(&lb.pd);
    // One environment for all cases: the heap outlives them, and so do its late binds (two at
    // most, across the run).
    let env = DeviceEnv {
        lb: &lb,
        heap: &heap,
        nic: std::sync::Mutex::new(()),
        extra_pds: std::sync::Mutex::new(Vec::new()),
    };
    // No shrinking: the heap is shared by the cases, so a failed case's leftovers would make
    // every shrink step fail on live bytes instead of on the real failure.
    let mut runner = TestRunner::new(Config { cases: 4, max_shrink_iters: 0, ..Config::default() });
    let strategy =
        (proptest::collection::vec(model::op(2 << 20), 1..25), proptest::collection::vec(model::op(2 << 20), 1..25));
    runner
        .run(&strategy, |(a, b)| {
            let (la, lb_) = std::thread::scope(|s| {
                let ta = s.spawn(|| model::SendLive(model::run_model(&heap, &a, 1, &env)));
                let tb = s.spawn(|| model::SendLive(model::run_model(&heap, &b, 2, &env)));
                (ta.join().unwrap().0, tb.join().unwrap().0)
            });
            let live: usize = la.iter().chain(&lb_).map(|l| l.layout.size()).sum();
            prop_assert_eq!(heap.stats().live_bytes, live as u64);
            // The NIC reads every live allocation with its chunk's lkey (here: the source of an
            // RDMA WRITE into a buffer exposed on its own).
            for l in la.iter().chain(&lb_) {
                let n = l.layout.size();
                // SAFETY: l is a live allocation of n bytes until it is freed below.
                let got = unsafe { nic_read(&lb, &heap, l.ptr.as_ptr(), n) };
                assert_bytes_eq(&got, &pattern(l.seed, n), "NIC sees the model's bytes");
            }
            for l in la.into_iter().chain(lb_) {
                // SAFETY: allocated from &heap with l.layout.
                unsafe { allocator_api2::alloc::Allocator::deallocate(&&heap, l.ptr, l.layout) };
            }
            prop_assert_eq!(heap.stats().live_bytes, 0);
            Ok(())
        })
        .unwrap();
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_numa_binding_is_visible_to_move_pages() {
    let nodes = online_nodes();
    if std::env::var("MRALLOC_IN_VM").is_ok() {
        assert!(nodes.len() >= 2, "scripts/test boots a 2-node NUMA VM; online nodes: {nodes:?}");
    }
    let pd = Pd::new(&open()).unwrap();
    for &node in nodes.iter().rev().take(2) {
        let heap = Heap::builder().bind(&pd).numa(NumaPolicy::Node(node)).build().unwrap();
        assert_eq!(heap.numa_node(), Some(node));
        for n in [4096usize, 100_000, 3 << 20] {
            let mut b = heap.alloc(n).unwrap();
            b.fill(1);
            let pages: Vec<*const u8> = (0..n).step_by(4096).map(|o| b.as_ptr().wrapping_add(o)).collect();
            let got = nodes_of_pages(&pages).unwrap();
            assert!(got.iter().all(|&g| g == node as i32), "{n}-byte buffer on node {node}: pages on {got:?}");
            assert_eq!(policy_of(b.as_ptr()), MPOL_BIND, "{n}-byte buffer's mapping is bound");
        }
        println!("NumaPolicy::Node({node}): every sampled page on node {node}");
    }
    // DeviceLocal (the default) follows the device's node; a device without one (rxe over
    // virtio in the VM) means no binding at all, and no error.
    let device_node = pd.context().numa_node();
    if std::env::var("MRALLOC_IN_VM").is_ok() {
        assert_eq!(device_node, None, "the VM's rxe0 sits on a virtio NIC without a NUMA node");
    }
    let heap = Heap::builder().bind(&pd).build().unwrap();
    assert_eq!(heap.numa_node(), device_node);
    let mut b = heap.alloc(3 << 20).unwrap();
    b.fill(1);
    let want = if device_node.is_some() { MPOL_BIND } else { MPOL_DEFAULT };
    assert_eq!(policy_of(b.as_ptr()), want, "DeviceLocal with device node {device_node:?}");
}

/// `NumaPolicy::DeviceLocal` (the default) binds chunks to the device's node: the VM's rxe0 has
/// none in sysfs, so a child process names one through `MRALLOC_NUMA_NODE` (the last online
/// node, not 0, so that the binding shows), and its heap's pages land there.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_device_local_follows_the_devices_node() {
    let nodes = online_nodes();
    if std::env::var(mralloc::verbs::NUMA_OVERRIDE).is_err() {
        if std::env::var("MRALLOC_IN_VM").is_ok() {
            assert!(nodes.len() >= 2, "scripts/test boots a 2-node NUMA VM; online nodes: {nodes:?}");
        }
        let node = *nodes.last().expect("an online node");
        let value = format!("{}:{node}", device_name());
        let child = spawn_test(
            "device_device_local_follows_the_devices_node",
            true,
            &[(mralloc::verbs::NUMA_OVERRIDE, &value), ("MRALLOC_WANT_NODE", &node.to_string())],
        );
        let out = finish_child(child, "DeviceLocal child");
        assert!(out.contains(&format!("DeviceLocal: every sampled page on node {node}")), "{out}");
        return;
    }
    let node: u32 = std::env::var("MRALLOC_WANT_NODE").unwrap().parse().unwrap();
    let pd = Pd::new(&open()).unwrap();
    assert_eq!(pd.context().numa_node(), Some(node), "the override names the device's node");
    let heap = Heap::builder().bind(&pd).build().unwrap();
    assert_eq!(heap.numa_node(), Some(node), "DeviceLocal follows the device");
    for n in [4096usize, 100_000, 3 << 20] {
        let mut b = heap.alloc(n).unwrap();
        b.fill(1);
        let pages: Vec<*const u8> = (0..n).step_by(4096).map(|o| b.as_ptr().wrapping_add(o)).collect();
        let got = nodes_of_pages(&pages).unwrap();
        assert!(got.iter().all(|&g| g == node as i32), "{n}-byte buffer: pages on {got:?}, want {node}");
        assert_eq!(policy_of(b.as_ptr()), MPOL_BIND, "{n}-byte buffer's mapping is bound");
    }
    println!("DeviceLocal: every sampled page on node {node}");
}

const MPOL_DEFAULT: i32 = 0;
const MPOL_BIND: i32 = 2;

/// The memory policy mode of the mapping holding `addr` (`get_mempolicy` with `MPOL_F_ADDR`).
fn policy_of(addr: *const u8) -> i32 {
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut mode: libc::c_int = -1;
    // SAFETY: get_mempolicy writes one int to `mode`; a NULL node mask with maxnode 0 is allowed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr,
            MPOL_F_ADDR,
        )
    };
    assert_eq!(r, 0, "get_mempolicy: {}", std::io::Error::last_os_error());
    mode
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_heaps_do_not_claim_each_others_memory() {
    let pd = Pd::new(&open()).unwrap();
    let a = Heap::builder().bind(&pd).build().unwrap();
    let b = Heap::builder().bind(&pd).build().unwrap();
    let x = a.alloc(100).unwrap();
    let keys = a.keys(x.as_ptr()).expect("the owning heap gives keys");
    assert_eq!(mralloc::keys_of(x.as_ptr()), Some(keys));
    assert!(b.keys(x.as_ptr()).is_none(), "another heap on the same PD claims nothing");
    assert!(b.keys_for(x.as_ptr(), &pd).is_none(), "not for an explicit PD either");
    let y = b.alloc(100).unwrap();
    assert!(a.keys(y.as_ptr()).is_none() && b.keys(y.as_ptr()).is_some());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_memlock_exhaustion_is_a_typed_error_and_the_heap_survives() {
    if std::env::var("MRALLOC_MEMLOCK_CHILD").is_err() {
        // Run the body in a child process: it lowers its own memlock limit.
        run_in_child(
            "device_memlock_exhaustion_is_a_typed_error_and_the_heap_survives",
            "MRALLOC_MEMLOCK_CHILD",
            &[],
            "memlock",
        );
        return;
    }
    // Lower the limit and drop the capability that ignores it *before* opening the device: the
    // kernel refuses uverbs writes on a file opened under other credentials.
    let limit: u64 = 32 << 20;
    let lim = libc::rlimit { rlim_cur: limit, rlim_max: limit };
    // SAFETY: setrlimit with a valid struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) }, 0);
    drop_ipc_lock();
    let lb = loopback();
    let heap = remote_heap(&lb.pd);
    let small = filled(&heap, 4096, 1);
    println!("pinned before the big request: {} KiB of {} KiB allowed", vm_pinned_kib(), limit >> 10);
    match heap.alloc(64 << 20) {
        Err(Error::Registration { errno, hint }) => {
            println!("64 MiB with memlock {limit} B: errno {errno}; {hint}");
            assert!(hint.contains("RLIMIT_MEMLOCK"), "{hint}");
        }
        other => panic!("expected Error::Registration, got {other:?}"),
    }
    assert!(heap.stats().registration_failures >= 1);
    // The heap is consistent: allocations from registered chunks still work and move data.
    for i in 0..16 {
        let src = filled(&heap, 8192, 50 + i);
        let dst = heap.alloc(8192).unwrap();
        let back = heap.alloc(8192).unwrap();
        write_read(&lb, &src, dst, &back, "after memlock failure");
    }
    drop(small);
    std::thread::sleep(Duration::from_millis(1));
    println!("memlock child: OK");
}

/// A 2 MiB-aligned, zeroed request that reaches the hook as an exact-size extent (jemalloc's
/// retry after its geometric grow was refused by the heap's limit) has the shape of a metadata
/// request. It used to be classified as metadata by that shape and handed out unregistered
/// (`keys() == None`); mralloc zeroes such requests itself now, so jemalloc never sees that
/// shape for data (and metadata is never registered).
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_two_mib_aligned_allocation_after_a_refused_grow_is_registered() {
    let lb = loopback();
    let probe = remote_heap(&lb.pd);
    let base = probe.stats().mapped_bytes; // what a fresh heap maps before its first buffer
    drop(probe);
    // Room for the request (4 MiB + a page at 2 MiB alignment) but not for jemalloc's first
    // grow (at least size + alignment - a page = 6 MiB).
    let heap =
        Heap::builder().bind(&lb.pd).access(Access::ALL_REMOTE).limit(base as usize + (5 << 20)).build().unwrap();
    let layout = std::alloc::Layout::from_size_align(4 << 20, 2 << 20).unwrap();
    let dst = heap.alloc_layout(layout).expect("the exact-size retry fits the limit");
    assert_eq!(dst.addr() % (2 << 20), 0);
    let (chunk_base, chunk_len) = chunk_of(dst.as_ptr()).unwrap();
    println!("chunk {chunk_base:#x} + {chunk_len} for the 4 MiB request; stats {:?}", heap.stats());
    assert!(chunk_len < 6 << 20, "not a grown chunk: jemalloc's exact-size retry was taken");
    assert!(dst.keys().is_some(), "the 2 MiB-aligned user chunk is registered");
    let other = remote_heap(&lb.pd);
    let src = filled(&other, 4 << 20, 77);
    let back = other.alloc(4 << 20).unwrap();
    write_read(&lb, &src, dst, &back, "2 MiB-aligned buffer");
}

/// The purge hazard with jemalloc's `process_madvise` purging asked for (off by default; any
/// user can switch it on through `_RJEM_MALLOC_CONF`): freed memory is purged and decayed, then
/// reused, and every reused buffer is RDMA-checked byte by byte. Runs in a child process (the
/// option is read when jemalloc starts). (With `dalloc: None` this still passed in this build —
/// see the note on `HOOKS` in src/heap/hooks.rs.)
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_purged_memory_stays_the_nics_even_with_process_madvise() {
    if std::env::var("MRALLOC_PURGE_CHILD").is_err() {
        let conf = [("_RJEM_MALLOC_CONF", "process_madvise_max_batch:64")];
        run_in_child(
            "device_purged_memory_stays_the_nics_even_with_process_madvise",
            "MRALLOC_PURGE_CHILD",
            &conf,
            "purge",
        );
        return;
    }
    let lb = loopback();
    let heap = remote_heap(&lb.pd);
    for round in 0..4u64 {
        let freed: Vec<_> = (0..32).map(|i| filled(&heap, 256 << 10, 1000 * round + i)).collect();
        drop(freed);
        heap.purge().unwrap();
        heap.decay().unwrap();
        for i in 0..32 {
            let src = filled(&heap, 256 << 10, 1000 * round + 500 + i);
            let dst = heap.alloc(256 << 10).unwrap();
            let back = heap.alloc(256 << 10).unwrap();
            write_read(&lb, &src, dst, &back, &format!("round {round}: reused after purge #{i}"));
        }
    }
    println!("purge child: OK");
}
