//! benches/pair_min/run.rs with `mralloc::heap::Global` as the process allocator.

#[global_allocator]
static A: mralloc::heap::Global = mralloc::heap::Global::new();

#[path = "pair_min/run.rs"]
mod run;

fn main() {
    run::run("global");
}
