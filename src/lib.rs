//! # mralloc — registered memory for RDMA that feels like `std`
//!
//! mralloc makes RDMA memory management disappear: memory comes out of allocators whose chunks
//! are already registered with the NIC, so any buffer can be handed to an RDMA operation with
//! its keys, and a thin, safe verbs layer moves it.
//!
//! This release contains the verbs core ([`verbs`]): devices, protection domains, memory
//! regions, completion queues and RC queue pairs, with typed errors.
//!
//! ## The whole path
//!
//! Open the device, register memory, connect two queue pairs (here both on one device, a
//! loopback connection), RDMA-WRITE from one buffer into the other and check the bytes:
//!
//! ```no_run
//! use std::time::Duration;
//! use mralloc::verbs::{Access, ConnectOptions, Context, Cq, Pd, Qp, RegisteredBuf, SendOp, SendWr};
//!
//! let ctx = Context::open_default()?;            // MRALLOC_DEVICE, or the first active device
//! let pd = Pd::new(&ctx)?;
//! let cq = Cq::new(&ctx, 64)?;
//! let (a, b) = (Qp::builder(&pd, &cq, &cq).build()?, Qp::builder(&pd, &cq, &cq).build()?);
//! a.connect(&b.endpoint(), &ConnectOptions::default())?;   // endpoints normally travel by TCP
//! b.connect(&a.endpoint(), &ConnectOptions::default())?;
//!
//! let mut src = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE)?;
//! let dst = RegisteredBuf::new(&pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! src[..11].copy_from_slice(b"hello, rdma");
//!
//! let sge = [src.sge(0..11)?];
//! // SAFETY: `src` and `dst` stay alive and untouched until the completion is polled below.
//! unsafe { a.post_send(&[SendWr::new(1, &sge, SendOp::Write(dst.mr().remote(0)?))])? };
//! cq.next(Duration::from_secs(5))?.ok()?;
//! assert_eq!(&dst[..11], b"hello, rdma");
//! # Ok::<(), mralloc::Error>(())
//! ```
//!
//! ## Getting an RDMA device
//!
//! Without an RDMA NIC, run programs under `scripts/softroce -- CMD`: it boots a small VM whose
//! kernel provides Soft-RoCE (`rdma_rxe`), a real kernel RDMA device, and sets `MRALLOC_DEVICE`
//! and `MRALLOC_GID_INDEX` for [`verbs::Context::open_default`].
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod error;
pub mod heap;
mod mmap;
mod remote;
pub mod verbs;

pub use error::{Error, Result};
pub use heap::{keys_of, keys_of_for, Buffer, Heap, Keys};
pub use remote::RemoteBuf;
