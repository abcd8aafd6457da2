//! The CPU backend: weights in their checkpoint's storage type, multi-row quantized kernels (AVX2 / AVX-512), a
//! growable KV cache per sequence, and the forward pass (docs/architecture.md).

pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod ops;
pub mod repack;
pub mod weights;

pub use kv_cache::KvCache;
pub use model::CpuModel;

#[cfg(test)]
mod tests;
