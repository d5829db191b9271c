// OwnedScatter (owned memory the NIC may write) is sealed: a type outside the crate cannot make
// itself a target of `post_read`/`post_recv` (or the async ones) by naming the trait — only by
// the `IoTarget` contract, which it must promise with `unsafe impl`.
struct Reused(Vec<u8>);

impl mralloc::transfer::OwnedScatter for Reused {}

fn main() {}
