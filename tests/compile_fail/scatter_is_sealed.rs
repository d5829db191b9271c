// Scatter (what the NIC may write) is sealed: a type outside the crate that is only Local —
// memory the NIC may read, here a shared borrow — cannot make itself a READ or receive target.
struct Shared<'a>(&'a [u8]);

// SAFETY: a shared borrow is valid, initialised memory while borrowed; the key is looked up.
unsafe impl mralloc::transfer::Local for Shared<'_> {
    fn local_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
    fn local_len(&self) -> usize {
        self.0.len()
    }
}

impl mralloc::transfer::Scatter for Shared<'_> {}

fn main() {}
