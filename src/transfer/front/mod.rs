//! The front ends over the one request pipeline: blocking (borrowed memory), `Pending`
//! (owned), `Batch` (many requests, few doorbells), and async (feature `tokio`).

#[cfg(feature = "tokio")]
pub(crate) mod aio;
pub(crate) mod batch;
pub(crate) mod borrowed;
pub(crate) mod ops;
pub(crate) mod pending;
