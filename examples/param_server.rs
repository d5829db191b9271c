//! `param_server`: synchronous data-parallel SGD over RDMA. Each step, every worker pulls the
//! parameters with an RDMA READ, computes its gradient, pushes it with an RDMA WRITE into its slot
//! of the server's registered heap and notifies with an immediate; the server averages the
//! gradients, applies the SGD update and tells the workers to go on. At the end the server
//! recomputes the same steps locally and checks the parameters are bit-for-bit equal.
//!
//! ```text
//! scripts/softroce -- cargo run --release --example param_server -- [--workers 2] [--steps 20] [--params 4096]
//! param_server server --port 7495 --workers 2 ... ; param_server worker --addr S:7495 --id 0 --workers 2 ...
//! ```

mod common;

use std::time::Instant;

use common::{fail, Args, Opt, Spec};
use mralloc::transfer::{Connection, Listener, Options, QpOptions, WaitMode, WaitOptions};
use mralloc::verbs::Access;
use mralloc::RemoteBuf;

const LR: f32 = 0.05;

static SPEC: Spec = Spec {
    name: "param_server",
    about: "Synchronous data-parallel SGD over RDMA: workers pull the parameters by READ and push gradients\n\
            by WRITE with immediate; the server applies SGD and checks the result against a local run.",
    no_role: "the server and --workers worker processes in this command (child processes)",
    roles: &[("server", "hold the parameters, run --steps steps"), ("worker", "compute gradients against --addr")],
    opts: &[
        Opt::num("workers", "N", "worker processes (default 2); the same on every process of a run"),
        Opt::num("steps", "N", "SGD steps (default 20)"),
        Opt::num("params", "N", "model parameters, f32 (default 4096); the same on every process of a run"),
        Opt::port("port", "the port to listen on (default 7495)").roles(&["server"]),
        Opt::text("addr", "HOST:PORT", "the server (default 127.0.0.1:7495)").roles(&["worker"]),
        Opt::num("id", "N", "this worker's number, 0 to workers-1 (default 0)").roles(&["worker"]),
    ],
};

/// The model: a quadratic bowl per worker, so gradients are deterministic and depend on the data
/// shard (the worker id) and on the current parameters.
fn gradient(params: &[f32], worker: usize, out: &mut [f32]) {
    for (i, (g, p)) in out.iter_mut().zip(params).enumerate() {
        let target = ((i * 7 + worker * 13) % 101) as f32 / 100.0 - 0.5;
        *g = 2.0 * (p - target);
    }
}

/// One SGD step from the workers' gradients, in worker order (same order as the local replay).
fn apply(params: &mut [f32], grads: &[Vec<f32>]) {
    let w = grads.len() as f32;
    for (i, p) in params.iter_mut().enumerate() {
        let mean = grads.iter().map(|g| g[i]).sum::<f32>() / w;
        *p -= LR * mean;
    }
}

fn initial(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect()
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns as bytes; the length is in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes"))).collect()
}

fn main() {
    let args = Args::parse(&SPEC);
    let r = match args.role.as_deref() {
        Some("server") => server(&args),
        Some("worker") => worker(&args),
        None => all(&args),
        Some(other) => fail(&format!("unknown role {other} (server | worker)")),
    };
    if let Err(e) = r {
        fail(&format!("param_server: {e}"));
    }
}

fn shape(args: &Args) -> (usize, usize, usize) {
    (args.num("workers", 2), args.num("steps", 20), args.num("params", 4096))
}

fn all(args: &Args) -> mralloc::Result<()> {
    let (workers, steps, params) = shape(args);
    let port = common::free_port();
    let common_args = vec![
        "--workers".into(),
        workers.to_string(),
        "--steps".into(),
        steps.to_string(),
        "--params".into(),
        params.to_string(),
    ];
    let mut sargs = vec!["--port".into(), port.to_string()];
    sargs.extend(common_args.clone());
    let server = common::spawn_role("server", &sargs);
    let mut children = Vec::new();
    for w in 0..workers {
        let mut wargs = vec!["--addr".into(), format!("127.0.0.1:{port}"), "--id".into(), w.to_string()];
        wargs.extend(common_args.clone());
        children.push((format!("worker {w}"), common::spawn_role("worker", &wargs)));
    }
    common::wait_all(children);
    common::wait_all(vec![("server".into(), server)]);
    println!("param_server: OK");
    Ok(())
}

fn server(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(None, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    let (workers, steps, n) = shape(args);
    let bytes = n * 4;
    // Parameters (workers READ them: a read-only key) and one gradient slot per worker (workers
    // WRITE them: the slots are exposed, and read here by copying out).
    let mut params = heap.alloc(bytes)?;
    params.copy_from_slice(as_bytes(&initial(n)));
    let grads = heap.alloc(workers * bytes)?.expose()?;
    let mut offer = Vec::new();
    offer.extend_from_slice(&params.remote()?.to_bytes());
    offer.extend_from_slice(&grads.remote().to_bytes());
    // Workers pull by READ and push by WRITE into this heap: the server's QPs allow both.
    let opts = Options {
        qp: QpOptions { remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ, ..Default::default() },
        wait: WaitOptions { mode: WaitMode::Event, ..Default::default() },
        ..Options::default()
    };
    let listener = Listener::bind(("0.0.0.0", args.num("port", 7495) as u16), &pd, opts)?;
    let conns: Vec<Connection> = (0..workers).map(|_| listener.accept_with(&offer)).collect::<mralloc::Result<_>>()?;
    println!("{workers} workers connected; {n} parameters; {steps} steps");
    let mut go = heap.alloc(4)?;
    let mut step_t = common::latencies();
    let t = Instant::now();
    for step in 0..steps {
        let s = Instant::now();
        go.copy_from_slice(&(step as u32).to_be_bytes());
        for c in &conns {
            c.send(&go)?; // "pull now"
        }
        for (w, c) in conns.iter().enumerate() {
            let imm = c.recv_imm()?; // the worker's gradient has landed
            if imm != step as u32 {
                fail(&format!("worker {w} pushed step {imm} during step {step}"));
            }
        }
        let landed = grads.to_vec();
        let g: Vec<Vec<f32>> = (0..workers).map(|w| floats(&landed[w * bytes..(w + 1) * bytes])).collect();
        let mut p = floats(&params);
        apply(&mut p, &g);
        params.copy_from_slice(as_bytes(&p));
        common::record(&mut step_t, s.elapsed());
    }
    go.copy_from_slice(&u32::MAX.to_be_bytes());
    for c in &conns {
        c.send(&go)?;
    }
    let secs = t.elapsed().as_secs_f64();
    // The same steps, computed locally.
    let mut local = initial(n);
    for _ in 0..steps {
        let g: Vec<Vec<f32>> = (0..workers)
            .map(|w| {
                let mut g = vec![0f32; n];
                gradient(&local, w, &mut g);
                g
            })
            .collect();
        apply(&mut local, &g);
    }
    let got = floats(&params);
    let same = got.iter().zip(&local).all(|(a, b)| a.to_bits() == b.to_bits());
    let loss: f32 = got.iter().map(|p| p * p).sum::<f32>() / n as f32;
    println!(
        "{steps} steps in {:.1} ms ({:.2} ms/step; per step {}); mean p^2 {loss:.5}; parameters {} the local computation",
        secs * 1e3,
        secs * 1e3 / steps.max(1) as f64,
        common::percentiles(&step_t),
        if same { "bit-for-bit equal to" } else { "DIFFER from" }
    );
    if !same {
        fail("distributed and local parameters differ");
    }
    Ok(())
}

fn worker(args: &Args) -> mralloc::Result<()> {
    let (pd, heap) = common::setup_on(None, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    let (_, _, n) = shape(args);
    let id = args.num("id", 0);
    let bytes = n * 4;
    let addr = args.str_or("addr", "127.0.0.1:7495");
    let conn = common::retry(|| Connection::connect(addr.as_str(), &pd, Options::default()))?;
    let blob = conn.peer_blob();
    let (params_r, grads_r) = (RemoteBuf::from_bytes(&blob[..20])?, RemoteBuf::from_bytes(&blob[20..40])?);
    let mut local = heap.alloc(bytes)?;
    let mut grad = heap.alloc(bytes)?;
    let mut go = heap.alloc(4)?;
    let mut g = vec![0f32; n];
    let mut steps = 0;
    loop {
        conn.recv(&mut go)?;
        let step = u32::from_be_bytes(go[..4].try_into().expect("4 bytes"));
        if step == u32::MAX {
            break;
        }
        conn.read(&mut local, &params_r, 0)?; // pull
        gradient(&floats(&local), id, &mut g);
        grad.copy_from_slice(as_bytes(&g));
        conn.write_with_imm(&grad, &grads_r, (id * bytes) as u64, step)?; // push + notify
        steps += 1;
    }
    println!("worker {id}: {steps} steps (pull by READ, push by WRITE with immediate)");
    Ok(())
}
