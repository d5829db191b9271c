//! Rails under faults found by review (each test failed on 4f8b16d): a buffer handed back with
//! slices in flight, a wait spinning with its send queue full of another transfer's requests,
//! one bad remote key failing good pieces, a fork()ed child touching the parent's rails. Run by
//! scripts/test.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::rails::{groups, inbox, setup};
use mralloc::RemoteDesc;

/// Post A (fills the send queues), post B, wait B first: B has no slice of its own in
/// flight, its rails' send queues are full of A's (completed, unreaped) requests, and
/// Striped::wait only yields: nobody reaps, B never finishes.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_wait_with_the_send_queue_full_of_another_transfers_requests_reaps_them() {
    const PAGE: usize = 4096;
    let (pd, heap, mut opts) = setup(PAGE, 64 << 20);
    opts.conn.qp.send_depth = 16;
    let (ours, _theirs) = groups(&pd, &opts, 1);
    let (_target, desc) = inbox(&heap, 1 << 20);
    let pieces: Vec<(mralloc::Buffer, RemoteDesc)> = (0..64)
        .map(|i| (heap.alloc(PAGE).unwrap(), desc.slice(i * PAGE as u64..(i + 1) * PAGE as u64).unwrap()))
        .collect();
    let a = ours.post_write_list(pieces);
    println!("A: {a:?}; info {:?}", ours.info());
    let b = ours.post_write(heap.alloc(PAGE).unwrap(), &desc, 0).map_err(|r| r.error).unwrap();
    println!("B: {b:?}");
    // Give A's 16 requests all the time they need to complete on the wire.
    std::thread::sleep(Duration::from_millis(500));
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let f = b.wait();
            done.store(true, Ordering::SeqCst);
            f
        });
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) && !done.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let hung = !done.load(Ordering::SeqCst);
        println!("B finished within 10 s: {}", !hung);
        // Unstick it: driving A reaps its completions, which frees the send queue.
        let fa = a.wait();
        let fb = h.join().unwrap();
        println!("A ok {} B ok {}", fa.is_ok(), fb.is_ok());
        assert!(!hung, "Striped::wait spun for 10 s with its send queue full of completed, unreaped requests");
    });
}

/// A one-buffer post_write whose rails die while it is being started returns the buffer in
/// `Rejected` although slices of it were posted and not yet completed/flushed/reaped.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_transfer_whose_rails_die_while_starting_never_hands_back_a_buffer_in_flight() {
    let (pd, heap, opts) = setup(4096, 64 << 20);
    let (_target, desc) = inbox(&heap, 1 << 20);
    let mut hits = 0;
    for round in 0..200 {
        let (ours, _theirs) = groups(&pd, &opts, 1);
        let go = AtomicBool::new(false);
        let result = std::thread::scope(|s| {
            s.spawn(|| {
                while !go.load(Ordering::SeqCst) {
                    std::hint::spin_loop();
                }
                // Close as soon as a slice is posted.
                while ours.info()[0].outstanding == 0 {
                    std::hint::spin_loop();
                }
                let _ = ours.close();
            });
            go.store(true, Ordering::SeqCst);
            match ours.post_write(heap.alloc(1 << 20).unwrap(), &desc, 0) {
                Ok(t) => {
                    drop(t.wait());
                    None
                }
                Err(rej) => {
                    // The caller now owns the buffer (could free or reuse it). What does the
                    // group still have posted from it?
                    let posted = ours.info()[0].outstanding;
                    let st = ours.rail(0).stats();
                    Some((rej.error.to_string(), rej.buf.is_some(), posted, st.sends_in_flight))
                }
            }
        });
        if let Some((e, has_buf, posted, sif)) = result {
            if has_buf && posted > 0 {
                hits += 1;
                println!(
                    "round {round}: Rejected({e}) gave the buffer back while {posted} bytes ({sif} requests) of it were still posted"
                );
            }
        }
        if hits >= 3 {
            break;
        }
    }
    assert_eq!(hits, 0, "post_write handed back a buffer the NIC may still use");
}

/// In a fork()ed child, Striped::progress touches the parent's CQ and locks (Pending::is_done
/// checks forked_copy first).
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_forked_child_stops_the_transfer_without_touching_it() {
    let (pd, heap, opts) = setup(64 << 10, 1 << 20);
    let (ours, _theirs) = groups(&pd, &opts, 2);
    let (_target, desc) = inbox(&heap, 16 << 20);
    let mut t = ours.post_write(heap.alloc(16 << 20).unwrap(), &desc, 0).map_err(|r| r.error).unwrap();
    // SAFETY: the child only calls progress and _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let over = t.progress();
        let info = ours.info();
        eprintln!("child: progress returned {over}; info {info:?}");
        unsafe { libc::_exit(if over { 3 } else { 4 }) };
    }
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, 0) };
    println!(
        "child: exited {} code {} signalled {} sig {}",
        libc::WIFEXITED(status),
        libc::WEXITSTATUS(status),
        libc::WIFSIGNALED(status),
        libc::WTERMSIG(status)
    );
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 3,
        "the child's progress says the transfer is over"
    );
    let f = t.wait();
    assert!(f.is_ok(), "the parent's transfer goes on: {f:?}");
}

/// One piece with a wrong rkey: its slice fails with REM_ACCESS_ERR (own fault) and kills its
/// rail; the good pieces' slices flushed behind it on that rail report the cause (the flush's
/// explanation is the first failure), so they are failed with the bad piece's error instead of
/// being posted again on the live rail.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_one_bad_remote_key_fails_its_piece_alone() {
    const P: usize = 64 << 10;
    let (pd, heap, opts) = setup(4096, 64 << 20);
    let (ours, _theirs) = groups(&pd, &opts, 2);
    let (_target, desc) = inbox(&heap, 64 * P);
    let mut bad = desc.slice(0..4096).unwrap().to_vec();
    for b in &mut bad[18 + 16..18 + 20] {
        *b ^= 0x5a;
    }
    let bad = RemoteDesc::from_bytes(&bad).unwrap();
    let mut pieces = vec![(heap.alloc(4096).unwrap(), bad)];
    for i in 1..64u64 {
        pieces.push((heap.alloc(P).unwrap(), desc.slice(i * P as u64..(i + 1) * P as u64).unwrap()));
    }
    let done = ours.post_write_list(pieces).wait();
    let errs: Vec<(usize, String)> = done.piece_errors().map(|(i, e)| (i, e.to_string())).collect();
    println!("rails: {:?}", done.rails());
    println!("{} pieces failed: first few {:?}", errs.len(), &errs[..errs.len().min(4)]);
    println!("info {:?}", ours.info());
    assert!(
        errs.len() == 1 && errs[0].0 == 0 && errs[0].1.contains("REM_ACCESS_ERR"),
        "only the piece with the bad key fails: {errs:?}"
    );
    assert_eq!(ours.info().iter().filter(|r| r.alive).count(), 1, "the bad piece's rail died, the other lives");
}

/// A parent thread reaping rail 0 (holding its queue lock at times) while the process forks:
/// the child's Striped::progress takes that lock before checking forked_copy and can hang.
#[test]
#[ignore = "needs an RDMA device: run scripts/test"]
fn device_a_forked_child_never_waits_on_the_parents_locks() {
    let (pd, heap, opts) = setup(64 << 10, 1 << 20);
    let (ours, _theirs) = groups(&pd, &opts, 1);
    let (_target, desc) = inbox(&heap, 16 << 20);
    let stop = AtomicBool::new(false);
    let mut hung = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let _ = ours.rail(0).progress();
            }
        });
        for _ in 0..40 {
            let mut t = ours.post_write(heap.alloc(16 << 20).unwrap(), &desc, 0).map_err(|r| r.error).unwrap();
            // SAFETY: the child only calls alarm, progress and _exit.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                unsafe { libc::alarm(3) };
                let over = t.progress();
                unsafe { libc::_exit(if over { 3 } else { 4 }) };
            }
            let mut status = 0;
            unsafe { libc::waitpid(pid, &mut status, 0) };
            if libc::WIFSIGNALED(status) {
                hung += 1;
                println!("child killed by signal {} (SIGALRM = {})", libc::WTERMSIG(status), libc::SIGALRM);
            }
            drop(t.wait());
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(hung, 0, "Striped::progress hung in {hung} of 40 fork()ed children");
}
