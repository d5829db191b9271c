//! `Poller`: one thread that reaps completions for many connections.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::transfer::engine::completion::Core;

struct Shared {
    cores: Mutex<Vec<Weak<Core>>>,
    stop: AtomicBool,
}

struct Thread {
    shared: Arc<Shared>,
    handle: Mutex<Option<JoinHandle<()>>>,
    /// A fork()ed child has no poller thread to join.
    born: Born,
}

impl Drop for Thread {
    fn drop(&mut self) {
        if !self.born.here() {
            std::mem::forget(self.handle.get_mut().take()); // the parent's thread
            return;
        }
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.lock().take() {
            let _ = h.join();
        }
    }
}

/// A dedicated thread that polls the completion queues of every connection it serves and wakes
/// their waiting threads, so those sleep instead of spinning. Optionally pinned to a CPU.
/// Connections opt in with `wait: WaitOptions { mode: WaitMode::Poller(poller.clone()), .. }`; the
/// thread stops when the last handle (and every connection it serves) is gone.
///
/// ```no_run
/// use mralloc::transfer::{Connection, Options, Poller, WaitMode, WaitOptions};
/// # let pd = mralloc::verbs::Pd::new(&mralloc::verbs::Context::open_default()?)?;
/// let poller = Poller::spawn(Some(1))?; // pinned to CPU 1
/// let opts = Options {
///     wait: WaitOptions { mode: WaitMode::Poller(poller.clone()), ..Default::default() },
///     ..Options::default()
/// };
/// let (a, b) = Connection::pair(&pd, &opts)?;
/// # Ok::<(), mralloc::Error>(())
/// ```
#[derive(Clone)]
pub struct Poller {
    thread: Arc<Thread>,
}

impl std::fmt::Debug for Poller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Poller").field("connections", &self.thread.shared.cores.lock().len()).finish()
    }
}

fn pin_to(cpu: usize) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain old data; CPU_SET writes inside it; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

impl Poller {
    /// Starts the polling thread, pinned to `cpu` if given.
    ///
    /// # Errors
    /// [`Error::Io`] if the thread cannot be spawned, or cannot be pinned to `cpu` (e.g. `EINVAL`
    /// for a CPU that is offline or outside the process's allowed set; the thread is stopped then).
    pub fn spawn(cpu: Option<usize>) -> Result<Poller> {
        let shared = Arc::new(Shared { cores: Mutex::new(Vec::new()), stop: AtomicBool::new(false) });
        let s = shared.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("mralloc-poller".into())
            .spawn(move || {
                let _ = tx.send(cpu.map(pin_to).transpose());
                run(&s);
            })
            .map_err(|source| Error::Io { what: "spawning the poller thread".into(), source })?;
        let thread = Arc::new(Thread { shared, handle: Mutex::new(Some(handle)), born: Born::now() });
        if let Ok(Err(source)) = rx.recv() {
            return Err(Error::Io { what: format!("pinning the poller thread to CPU {}", cpu.unwrap_or(0)), source });
        }
        Ok(Poller { thread })
    }

    pub(crate) fn serve(&self, core: &Arc<Core>) {
        self.thread.shared.cores.lock().push(Arc::downgrade(core));
    }
}

fn run(shared: &Shared) {
    let mut idle = 0u32;
    let mut live: Vec<Arc<Core>> = Vec::new();
    while !shared.stop.load(Ordering::Acquire) {
        live.clear();
        shared.cores.lock().retain(|w| match w.upgrade() {
            Some(c) => {
                live.push(c);
                true
            }
            None => false,
        });
        let mut got = 0;
        for c in &live {
            got += c.progress().unwrap_or(0);
        }
        if got > 0 {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if live.is_empty() || idle > 100_000 {
                std::thread::sleep(Duration::from_micros(200));
            } else if idle % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
