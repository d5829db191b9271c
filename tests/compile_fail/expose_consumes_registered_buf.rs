// Exposing a RegisteredBuf moves it: no reference to its bytes survives the expose.
use mralloc::verbs::{Access, Pd, RegisteredBuf};

fn f(pd: &Pd) -> mralloc::Result<()> {
    let mut buf = RegisteredBuf::new(pd, 4096, Access::LOCAL_WRITE)?;
    let exposed = buf.expose(Access::REMOTE_WRITE)?;
    buf[0] = 1; // error: `buf` was moved into the exposure
    drop(exposed);
    Ok(())
}

fn main() {}
