//! Small registered scratch buffers: landing words for the old values of async atomics, and the
//! control channel's message frames.
//!
//! An atomic writes the remote word's old value into 8 local bytes. An async atomic may be
//! cancelled while the NIC still has to write them, so the word is owned by the operation like
//! any buffer: a [`Word`] is an [`IoBufMut`] taken from the connection's pool, parked with the
//! connection if the future is dropped, and back in the pool only once its completion (or
//! flush) has been reaped. Control frames are the same thing, 64 bytes long.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::fork::Born;
use crate::transfer::{IoBuf, IoBufMut};
use crate::verbs::{Access, Pd, RegisteredBuf};

/// Registered words of `size` bytes, in one-page chunks made as needed; a word goes back to the
/// free list only when its [`Word`] is dropped.
pub(crate) struct Words {
    pd: Pd,
    /// A fork()ed child's copy gives nothing back (a parent thread may have held the lock).
    born: Born,
    size: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    chunks: Vec<Arc<RegisteredBuf>>,
    /// (chunk, word) pairs not owned by any operation.
    free: Vec<(u32, u32)>,
}

/// Bytes of a registered chunk (one page).
const CHUNK: usize = 4096;

impl Words {
    /// A pool of `size`-byte words (a power of two dividing a page, at least 8: words are
    /// 8-aligned).
    pub(crate) fn new(pd: &Pd, size: usize) -> Arc<Words> {
        debug_assert!(size.is_power_of_two() && (8..=CHUNK).contains(&size));
        Arc::new(Words { pd: pd.clone(), born: Born::now(), size, state: Mutex::new(State::default()) })
    }

    /// A free word, registering another chunk if every word is in flight.
    ///
    /// # Errors
    /// [`Error::Verbs`] if registering a new chunk fails.
    pub(crate) fn take(self: &Arc<Words>) -> Result<Word> {
        let mut st = self.state.lock();
        if st.free.is_empty() {
            let c = u32::try_from(st.chunks.len())
                .map_err(|_| Error::InvalidArgument("too many atomic landing words".into()))?;
            st.chunks.push(Arc::new(RegisteredBuf::new(&self.pd, CHUNK, Access::LOCAL_WRITE)?));
            st.free.extend((0..(CHUNK / self.size) as u32).rev().map(|i| (c, i)));
        }
        let (c, i) = st.free.pop().expect("a chunk was just added");
        Ok(Word { words: self.clone(), chunk: st.chunks[c as usize].clone(), at: (c, i) })
    }
}

/// One word, owned by an operation.
pub(crate) struct Word {
    words: Arc<Words>,
    chunk: Arc<RegisteredBuf>,
    at: (u32, u32),
}

impl Word {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: the index is below CHUNK / size, so the word lies inside the chunk.
        unsafe { self.chunk.map_ptr().add(self.words.size * self.at.1 as usize) }
    }

    /// The first 8 bytes as the NIC wrote them (an atomic's old value; call after the
    /// operation's completion was claimed).
    pub(crate) fn value(&self) -> u64 {
        // SAFETY: 8 bytes inside the word, 8-aligned (page-aligned chunk, power-of-two words of
        // at least 8 bytes); the operation that wrote it has completed, so no DMA is in flight.
        u64::from_ne_bytes(unsafe { std::ptr::read_volatile(self.ptr().cast::<[u8; 8]>()) })
    }

    /// The word's bytes (call when no operation is in flight on it).
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `size` bytes inside the registered chunk, which this Word's Arc keeps alive;
        // this Word owns them exclusively (see the IoBuf impl), and the caller has no operation
        // in flight on them, so nothing writes them while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.words.size) }
    }

    /// Copies `src` (at most the word's size) to the start of the word.
    pub(crate) fn fill(&mut self, src: &[u8]) {
        let n = src.len().min(self.words.size);
        // SAFETY: as `bytes`, and `&mut self` excludes every other access through this Word.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr(), n) };
    }
}

impl Drop for Word {
    fn drop(&mut self) {
        if self.words.born.here() {
            self.words.state.lock().free.push(self.at);
        }
    }
}

// SAFETY: the word lies in a registered chunk that the Word's Arc keeps alive (a leaked Word
// keeps it forever); its index left the free list when this Word was made and returns only in
// Drop, so no other Word (and nothing else: the pool never reads or writes words) touches these
// 8 bytes meanwhile; the chunk's region covers all of it.
unsafe impl IoBuf for Word {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr()
    }
    fn bytes_len(&self) -> usize {
        self.words.size
    }
    fn lkey_for(&self, pd: &Pd) -> Option<u32> {
        self.chunk.mr().lkey_in(pd)
    }
}

// SAFETY: as above; the pointer comes from the mapping itself (not a shared slice), registered
// with LOCAL_WRITE.
unsafe impl IoBufMut for Word {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr()
    }
}
