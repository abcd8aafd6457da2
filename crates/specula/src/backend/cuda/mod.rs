//! The CUDA backend (feature `cuda`): weights, KV caches and activations in device memory, hand-written kernels
//! (kernels.cu, compiled by NVRTC for the card when a model loads), logits that stay on the device until read.
//!
//! The CUDA driver and NVRTC are opened at run time, so this builds anywhere; on a machine without them, loading a
//! model on `cuda` fails with an error that says which library is missing. docs/gpu.md says how to build and run.
//!
//! State of this backend (docs/gpu.md): bf16 weights in the tensor-core GEMV's tiled layout (F32/F16/BF16
//! converted at load; the GGUF quant types dequantized to bf16 at load, correct but 2-4x the bytes of native quant
//! kernels), f32 activations and KV cache, each step shape captured once as a CUDA graph, batches of any
//! sequences and tree masks of up to 64 new rows.
//!
//! `layout` (how the GEMV tiles weights and splits its work) is plain Rust, compiled and tested without the
//! feature.

// Declared first: its launch macros are used by the modules below.
#[cfg(feature = "cuda")]
#[macro_use]
mod ops;
#[cfg(feature = "cuda")]
mod cache;
#[cfg(feature = "cuda")]
pub mod clock;
#[cfg(feature = "cuda")]
pub mod context;
#[cfg(feature = "cuda")]
mod head;
pub mod layout;
#[cfg(feature = "cuda")]
mod model;
pub mod padding;

#[cfg(feature = "cuda")]
pub use cache::CudaKvCache;
#[cfg(feature = "cuda")]
pub use context::Gpu;
#[cfg(feature = "cuda")]
pub use head::CudaHead;
#[cfg(feature = "cuda")]
pub use model::CudaModel;

/// The kernels' source, compiled at load.
#[cfg(feature = "cuda")]
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// A CUDA error with the operation that failed.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_err(op: &str, e: impl std::fmt::Display) -> crate::error::Error {
    crate::error::Error::Cuda(format!("{op}: {e}"))
}

#[cfg(all(test, feature = "cuda"))]
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
            for kernel in super::context::KERNEL_NAMES {
                assert!(
                    text.contains(&format!(".entry {kernel}(")),
                    "{arch}: no {kernel} in the PTX"
                );
            }
            // Programmatic dependent launch exists from sm_90: compiled in there, compiled out before.
            assert_eq!(
                text.contains("griddepcontrol.wait"),
                arch == "sm_90",
                "{arch}: griddepcontrol guard"
            );
        }
    }
}
