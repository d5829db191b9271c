//! A heap dropped while buffers of it live ("draining") is torn down by the drop of its last
//! buffer, on whichever thread that happens, with no thread of the heap's own (host: unbound
//! heaps). A test binary of its own: the draining list and the threads are process-wide.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mralloc::heap::{chunk_of, draining_heaps, Heap};

/// The tests look at process-wide state: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim_end().to_string())
        .collect()
}

/// Counts the heap teardowns (`heap torn down`, a debug event of `mralloc::heap::shared`) on
/// the thread it is the default subscriber of.
struct Teardowns(AtomicUsize);

impl tracing::Subscriber for Teardowns {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        meta.module_path() == Some("mralloc::heap::shared")
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == tracing::Level::DEBUG {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// How many heaps `f` tears down on this thread (the liveness thread's, or any other's, are
/// not counted).
fn teardowns_here(f: impl FnOnce()) -> usize {
    let seen = Arc::new(Teardowns(AtomicUsize::new(0)));
    tracing::subscriber::with_default(Arc::clone(&seen), f);
    seen.0.load(Ordering::Relaxed)
}

/// Looks at the process's threads for `span` (a thread names itself just after it starts):
/// none may be a heap's own (`mralloc-heap-...`; `comm` keeps 15 bytes of a name).
fn no_heap_thread_for(span: Duration, when: &str) {
    let start = Instant::now();
    loop {
        let names = thread_names();
        assert!(
            !names.iter().any(|n| n.starts_with("mralloc-heap")),
            "{when}: a thread of the heap's own is running ({names:?})"
        );
        if start.elapsed() >= span {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Drops a heap with live buffers, then the buffers on this thread: the last one's drop tears
/// the heap down, on this thread (not the process's liveness thread, which tears down what a
/// drop may not).
#[test]
fn the_last_buffers_drop_tears_a_dropped_heap_down() {
    let _one = one_at_a_time();
    for round in 0..3 {
        let heap = Heap::builder().build().unwrap();
        let mut bufs: Vec<_> = (0..3).map(|i| heap.alloc(4096 << i).unwrap()).collect();
        let addr = bufs[0].as_ptr();
        let before = draining_heaps();
        drop(heap);
        assert_eq!(draining_heaps(), before + 1, "the heap waits for its buffers");
        if round == 0 {
            no_heap_thread_for(Duration::from_millis(30), "after the heap's drop");
        }
        let last = bufs.pop().unwrap();
        drop(bufs);
        assert!(chunk_of(addr).is_some(), "a buffer still lives: the heap's chunks stay");
        assert_eq!(draining_heaps(), before + 1);
        assert_eq!(teardowns_here(|| drop(last)), 1, "round {round}: the last buffer's drop tore the heap down");
        assert!(chunk_of(addr).is_none(), "round {round}: the heap's chunks are unmapped");
        assert_eq!(draining_heaps(), before, "the heap left the draining list");
    }
    no_heap_thread_for(Duration::from_millis(10), "after the teardowns");
}

/// As above, with the buffers allocated on this thread and freed on two others that never used
/// the heap: this thread's live-byte counter stays up, theirs go below zero, and only their sum
/// says when the last buffer is gone.
#[test]
fn buffers_of_a_dropped_heap_freed_on_other_threads_tear_it_down() {
    let _one = one_at_a_time();
    for round in 0..3 {
        let heap = Heap::builder().build().unwrap();
        let mut first: Vec<_> = (0..64).map(|_| heap.alloc(512).unwrap()).collect();
        let second = first.split_off(32);
        let addr = first[0].as_ptr() as usize;
        let before = draining_heaps();
        drop(heap);
        std::thread::spawn(move || drop(first)).join().unwrap();
        assert!(chunk_of(addr as *const u8).is_some(), "half the buffers still live: the chunks stay");
        assert_eq!(draining_heaps(), before + 1);
        let torn_down_there = std::thread::spawn(move || teardowns_here(|| drop(second))).join().unwrap();
        assert_eq!(torn_down_there, 1, "round {round}: the last buffer's drop (on another thread) tore the heap down");
        assert!(chunk_of(addr as *const u8).is_none(), "round {round}: the heap's chunks are unmapped");
        assert_eq!(draining_heaps(), before);
    }
    no_heap_thread_for(Duration::from_millis(10), "after the teardowns");
}

/// A global subscriber that, like tracing-subscriber's fmt layer, formats through a
/// thread-local: at thread exit, once that thread-local is gone, its `with` panics.
struct ThreadLocalFmt;
thread_local! { static FMT: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) }; }
impl tracing::Subscriber for ThreadLocalFmt {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        FMT.with(|b| b.borrow_mut().push_str(e.metadata().name()));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A thread-local holding a buffer of a dropped heap: its destructor, at thread exit, frees the
/// heap's last buffer and tears the heap down there — where the subscriber's own thread-local
/// is gone and its panic would abort the process, were teardown's logging not contained. Runs
/// in a child process (the subscriber is process-wide).
#[test]
fn a_heap_torn_down_in_a_thread_local_destructor_does_not_abort() {
    const CHILD: &str = "MRALLOC_TEST_TLS_TEARDOWN_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_heap_torn_down_in_a_thread_local_destructor_does_not_abort", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "the child died ({:?}):\n{text}", out.status);
        assert!(text.contains("teardown done"), "the child did not finish:\n{text}");
        return;
    }
    thread_local! { static SCRATCH: std::cell::RefCell<Option<mralloc::heap::Buffer>> = const { std::cell::RefCell::new(None) }; }
    tracing::subscriber::set_global_default(ThreadLocalFmt).unwrap();
    let heap = Heap::builder().build().unwrap();
    let h2 = heap.clone();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        // The buffer's thread-local first, then the subscriber's (destroyed in reverse order).
        SCRATCH.with(|s| *s.borrow_mut() = Some(h2.alloc(4096).unwrap()));
        drop(h2);
        ready_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        tracing::info!("worker done");
    });
    ready_rx.recv().unwrap();
    drop(heap);
    assert_eq!(draining_heaps(), 1);
    go_tx.send(()).unwrap();
    worker.join().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while draining_heaps() != 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(draining_heaps(), 0, "torn down");
    eprintln!("teardown done");
}
