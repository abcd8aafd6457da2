//! The CUDA backend (feature `cuda`): weights, KV caches and activations in device memory, hand-written kernels
//! (kernels.cu, compiled by NVRTC for the card when a model loads), logits that stay on the device until read.
//!
//! The CUDA driver and NVRTC are opened at run time, so this builds anywhere; on a machine without them, loading a
//! model on `cuda` fails with an error that says which library is missing. docs/gpu.md says how to build and run.
//!
//! State of this backend (2026-12-01, first increment): bf16 weights (F32/F16/BF16 converted at load; the GGUF
//! quant types dequantized to bf16 at load, which is correct but reads 2-4x the bytes of native quant kernels),
//! f32 activations and KV cache, one launch per kernel (no CUDA graphs yet), batches of any sequences and tree
//! masks of up to 64 new rows.

mod cache;
pub mod clock;
pub mod context;
mod model;

pub use cache::CudaKvCache;
pub use context::Gpu;
pub use model::CudaModel;

use crate::error::Error;

/// The kernels' source, compiled at load.
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// A CUDA error with the operation that failed.
pub(crate) fn cuda_err(op: &str, e: impl std::fmt::Display) -> Error {
    Error::Cuda(format!("{op}: {e}"))
}

#[cfg(test)]
mod tests {
    /// Every kernel compiles for Hopper and for an older architecture, with no GPU: NVRTC alone (in CI, the
    /// `nvidia-cuda-nvrtc` wheel that scripts/test.sh installs). Without NVRTC the test says so loudly, and
    /// fails when `SPECULA_REQUIRE_NVRTC` is set.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !super::context::nvrtc_available() {
            eprintln!(
                "WARNING: NVRTC (libnvrtc.so.13) is not loadable here: the CUDA kernels were NOT compiled \
                 (scripts/test.sh installs it from PyPI and sets LD_LIBRARY_PATH)"
            );
            assert!(
                std::env::var_os("SPECULA_REQUIRE_NVRTC").is_none(),
                "SPECULA_REQUIRE_NVRTC is set but NVRTC cannot be loaded"
            );
            return;
        }
        for arch in ["sm_90", "sm_80"] {
            let ptx = super::context::compile_kernels(arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            for kernel in ["gemv_bf16", "attention", "argmax_rows", "kv_keep_rows"] {
                assert!(text.contains(kernel), "{arch}: no {kernel} in the PTX");
            }
        }
    }
}
