//! One sequence's KV cache in device memory, allocated once for its whole capacity (so CUDA graphs can capture
//! fixed pointers). Layout: `[layer][keys | values][kv_head][slot][head_dim]`, f32.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{cuda_err, Gpu};
use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::forward::SequenceCache;

pub struct CudaKvCache {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) data: CudaSlice<f32>,
    pub(crate) capacity: usize,
    pub(crate) len: usize,
    pub(crate) num_layers: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
}

impl CudaKvCache {
    pub fn new(gpu: Arc<Gpu>, config: &Config, capacity: usize) -> Result<Self> {
        let elements = config
            .num_layers
            .checked_mul(2 * config.kv_dim())
            .and_then(|n| n.checked_mul(capacity))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("a KV cache of {capacity} positions overflows"))
            })?;
        let (free, _) = gpu.memory()?;
        if elements * 4 > free {
            return Err(Error::Cuda(format!(
                "a KV cache of {capacity} positions needs {:.2} GB but the GPU has {:.2} GB free",
                elements as f64 * 4e-9,
                free as f64 * 1e-9
            )));
        }
        let data = gpu
            .stream
            .alloc_zeros::<f32>(elements.max(1))
            .map_err(|e| cuda_err("allocating a KV cache", e))?;
        Ok(CudaKvCache {
            gpu,
            data,
            capacity,
            len: 0,
            num_layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        })
    }

    /// Replaces its contents with the first `n` positions of `src` (same shape): one device copy per layer,
    /// keys or values, and KV head (the two caches' capacities, hence strides, may differ).
    pub fn copy_prefix(&mut self, src: &CudaKvCache, n: usize) -> Result<()> {
        crate::model::forward::check_prefix_copy(src.len, n, self.capacity)?;
        if (src.num_layers, src.kv_heads, src.head_dim)
            != (self.num_layers, self.kv_heads, self.head_dim)
        {
            return Err(Error::InvalidArgument(format!(
                "cannot copy positions between KV caches of different shapes ({} layers x {} heads x {} against \
                 {} x {} x {})",
                src.num_layers, src.kv_heads, src.head_dim, self.num_layers, self.kv_heads, self.head_dim
            )));
        }
        self.len = 0;
        let hd = self.head_dim;
        if n > 0 && !self.copy_prefix_strided(src, n) {
            for block in 0..self.num_layers * 2 * self.kv_heads {
                let from = src
                    .data
                    .slice(block * src.capacity * hd..block * src.capacity * hd + n * hd);
                let at = block * self.capacity * hd;
                let mut to = self.data.slice_mut(at..at + n * hd);
                self.gpu
                    .stream
                    .memcpy_dtod(&from, &mut to)
                    .map_err(|e| cuda_err("copying KV cache positions", e))?;
            }
        }
        self.len = n;
        Ok(())
    }

    /// The first `n` positions of every (layer, keys or values, KV head) block of `src` in one strided device copy
    /// (the blocks lie `capacity` positions apart in both caches): a prefix-cache hit on a 28-layer model was 112
    /// copies, each a call the engine waited through. False when the driver refuses it (the caller copies block
    /// by block).
    fn copy_prefix_strided(&mut self, src: &CudaKvCache, n: usize) -> bool {
        use cudarc::driver::sys;
        let row = self.head_dim * std::mem::size_of::<f32>();
        let (from, _) = src.data.device_ptr(&self.gpu.stream);
        let (to, _) = self.data.device_ptr_mut(&self.gpu.stream);
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: from,
            srcArray: std::ptr::null_mut(),
            srcPitch: src.capacity * row,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: to,
            dstArray: std::ptr::null_mut(),
            dstPitch: self.capacity * row,
            WidthInBytes: n * row,
            Height: self.num_layers * 2 * self.kv_heads,
        };
        // SAFETY: both ranges lie inside their buffers (n <= both capacities, Height blocks of capacity rows), and
        // the copy is ordered on the one stream every use of both caches goes to.
        unsafe {
            sys::cuMemcpy2DAsync_v2(&copy, self.gpu.stream.cu_stream())
                == sys::CUresult::CUDA_SUCCESS
        }
    }

    /// The device address of the cache (for the kernels' per-sequence table).
    pub(crate) fn device_ptr(&self) -> u64 {
        let (ptr, _sync) = self.data.device_ptr(&self.gpu.stream);
        ptr
    }
}

impl SequenceCache for CudaKvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    fn keep_new_rows(&mut self, base: usize, rows: &[usize]) -> Result<()> {
        crate::model::forward::check_keep_rows(self.len, base, rows)?;
        if !rows.is_empty() {
            let src: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let stream = &self.gpu.stream;
            let src = stream
                .clone_htod(&src)
                .map_err(|e| cuda_err("uploading kept rows", e))?;
            let blocks = (self.num_layers * 2 * self.kv_heads) as u32;
            let (capacity, count, base32, hd) = (
                self.capacity as u32,
                rows.len() as i32,
                base as u32,
                self.head_dim as i32,
            );
            let mut launch = stream.launch_builder(&self.gpu.kernels.kv_keep_rows);
            launch
                .arg(&mut self.data)
                .arg(&capacity)
                .arg(&src)
                .arg(&count)
                .arg(&base32)
                .arg(&hd);
            // SAFETY: the arguments match kv_keep_rows's signature; the grid covers the cache's heads.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(|e| cuda_err("kv_keep_rows", e))?;
        }
        self.len = base + rows.len();
        Ok(())
    }

    fn copy_prefix_from(&mut self, src: &dyn SequenceCache, n: usize) -> Result<()> {
        let src = src.as_any().downcast_ref::<CudaKvCache>().ok_or_else(|| {
            Error::InvalidArgument(
                "a GPU KV cache can take positions only from another GPU KV cache".into(),
            )
        })?;
        if !Arc::ptr_eq(&src.gpu, &self.gpu) {
            return Err(Error::InvalidArgument(
                "cannot copy KV cache positions between GPUs".into(),
            ));
        }
        self.copy_prefix(src, n)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
