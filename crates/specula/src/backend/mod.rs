//! Where a model runs: one folder per device behind the forward-pass interface of [`crate::model::forward`].

pub mod cpu;
/// The CUDA backend; without the `cuda` feature only its layout logic (tested on the CPU) is compiled.
pub mod cuda;

use std::fmt;

use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::forward::Model;
use crate::model::tensors::{TensorNames, WeightSource};

/// Loads a model's weights from `src` onto `device`.
pub fn load(
    device: Device,
    config: Config,
    src: &dyn WeightSource,
    names: &TensorNames,
) -> Result<Box<dyn Model>> {
    match device {
        Device::Cpu => Ok(Box::new(cpu::CpuModel::load(config, src, names)?)),
        #[cfg(feature = "cuda")]
        Device::Cuda(index) => {
            let gpu = std::sync::Arc::new(cuda::Gpu::open(index)?);
            Ok(Box::new(cuda::CudaModel::load(gpu, config, src, names)?))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(Error::InvalidArgument(format!(
            "--device {device}: this specula was built without CUDA support; rebuild with `--features cuda` \
             (docs/gpu.md)"
        ))),
    }
}

/// A device to run on, as `--device` names it: `cpu`, `cuda` (the first GPU) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

/// A model of `config`'s shape with seeded random weights, made on `device` (GPU only: a real shape's weights
/// are gigabytes, made in a moment by the GPU).
pub fn load_random(device: Device, config: Config, seed: u64) -> Result<Box<dyn Model>> {
    #[cfg(not(feature = "cuda"))]
    let _ = (&config, seed);
    match device {
        Device::Cpu => Err(Error::InvalidArgument(
            "--random-weights makes the weights on the GPU: add --device cuda".into(),
        )),
        #[cfg(feature = "cuda")]
        Device::Cuda(index) => {
            let gpu = std::sync::Arc::new(cuda::Gpu::open(index)?);
            Ok(Box::new(cuda::CudaModel::random(gpu, config, seed)?))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(Error::InvalidArgument(format!(
            "--device {device}: this specula was built without CUDA support; rebuild with `--features cuda` \
             (docs/gpu.md)"
        ))),
    }
}

impl std::str::FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        match s {
            "cpu" => return Ok(Device::Cpu),
            "cuda" | "gpu" => return Ok(Device::Cuda(0)),
            _ => {}
        }
        if let Some(index) = s.strip_prefix("cuda:") {
            return index.parse().map(Device::Cuda).map_err(|_| {
                Error::InvalidArgument(format!(
                    "--device {s:?}: the GPU index must be a number, as in cuda:0"
                ))
            });
        }
        Err(Error::InvalidArgument(format!(
            "--device {s:?} is not a device; use cpu, cuda or cuda:N"
        )))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["tpu", "cuda:x", "cuda:-1", ""] {
            let err = bad.parse::<Device>().unwrap_err().to_string();
            assert!(err.contains("--device"), "{err}");
        }
    }
}
