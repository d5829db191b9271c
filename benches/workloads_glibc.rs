//! The workloads of benches/workloads with the system allocator (glibc's malloc): no
//! `#[global_allocator]`.

#[path = "workloads/mod.rs"]
mod w;

fn main() {
    w::main("glibc");
}
