//! One GPU: its context, the stream every step runs on, and the compiled kernels.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::{cuda_err, KERNELS_SOURCE};
use crate::error::{Error, Result};

/// Every kernel `Gpu::new` loads (the NVRTC test checks each is in the compiled PTX).
pub const KERNEL_NAMES: &[&str] = &[
    "embed_rows",
    "rms_norm",
    "split_rows",
    "gemv_mma_8_d4",
    "gemv_mma_8_d2",
    "gemv_mma_16",
    "gemv_mma_32",
    "gemv_mma_24",
    "gemv_q4k_8_d4",
    "gemv_q4k_8_d2",
    "gemv_q4k_16",
    "gemv_q4k_32",
    "gemv_q4k_24",
    "gemv_i8_8_d4",
    "gemv_i8_8_d2",
    "gemv_i8_16",
    "gemv_i8_32",
    "gemv_i8_24",
    "gemv_mixed_8_d4",
    "gemv_mixed_8_d2",
    "gemv_mixed_16",
    "gemv_mixed_32",
    "gemv_mixed_24",
    "gemm_mma_32",
    "gemm_mma_64",
    "gemm_staged_32",
    "gemm_staged",
    "gemm_staged_q4k_32",
    "gemm_staged_q4k",
    "gemm_staged_i8_32",
    "gemm_staged_i8",
    "splitk_reduce",
    "qkv_post",
    "rope_angles",
    "attention_128",
    "attention_256",
    "attention_128_g2",
    "attention_128_g3",
    "attention_128_g4",
    "attention_list_128",
    "attention_list_256",
    "attention_list_128_g2",
    "attention_list_128_g3",
    "attention_list_128_g4",
    "gather_rows",
    "copy_rows_by_address",
    "head_inputs",
    "gather_rms_norm",
    "chain_next",
    "chain_next_rows",
    "argmax_partial",
    "argmax_final",
    "gather_columns",
    "top_token",
    "top_k_log_probs",
    "fill_random_bf16",
    "kv_keep_rows",
];

/// Attention kernels by variant (`ops::attention_variant`): head dimension <= 128, <= 256, then <= 128 taking 2, 3
/// and 4 heads of one KV head a block.
pub const ATTENTION_VARIANTS: usize = 5;
const ATTENTION_GRID: [&str; ATTENTION_VARIANTS] = [
    "attention_128",
    "attention_256",
    "attention_128_g2",
    "attention_128_g3",
    "attention_128_g4",
];
/// `get` of each variant's kernel name, in variant order.
fn by_variant<T>(
    names: [&'static str; ATTENTION_VARIANTS],
    get: impl Fn(&str) -> Result<T>,
) -> Result<[T; ATTENTION_VARIANTS]> {
    let all = names.into_iter().map(get).collect::<Result<Vec<T>>>()?;
    all.try_into()
        .map_err(|_| Error::Cuda("the attention kernel table".into()))
}

const ATTENTION_LIST: [&str; ATTENTION_VARIANTS] = [
    "attention_list_128",
    "attention_list_256",
    "attention_list_128_g2",
    "attention_list_128_g3",
    "attention_list_128_g4",
];

/// The kernels of kernels.cu, loaded.
pub struct Kernels {
    _module: Arc<CudaModule>,
    pub embed_rows: CudaFunction,
    pub rms_norm: CudaFunction,
    /// Activations split into the GEMV's bf16 hi + lo fragments (where no producing kernel writes them so).
    pub split_rows: CudaFunction,
    /// The tensor-core GEMV: 8 tokens a block with 4 or 2 chunks in flight a warp, 16 and 32 tokens a block, then
    /// 24 tokens a block (`ops::launch_gemv_tile` picks by rows).
    pub gemv_mma: [CudaFunction; 5],
    /// The same five over native Q4_K weights (layout.rs `tile_q4k`): the same sums, bit for bit.
    pub gemv_q4k: [CudaFunction; 5],
    /// And over scaled-int8 weights (native Q6_K, Q8_0, Q5_0: layout.rs `tile_q6k` ...).
    pub gemv_i8: [CudaFunction; 5],
    /// And over a matrix stacked from parts of different formats (`layout::MixedParts`), each row block
    /// through its part's path.
    pub gemv_mixed: [CudaFunction; 5],
    /// The same sums for many tokens, four row blocks a block: 32 and 64 tokens a block (off unless
    /// `SPECULA_CUDA_GEMM_ROWS` asks for it: slower than the GEMV since activations come split).
    pub gemm_mma: [CudaFunction; 2],
    /// The same sums with each chunk's operands staged in shared memory ahead of use, over bf16, nibble and
    /// scaled-int8 tiles, 32 then 64 tokens a block for each (`SPECULA_CUDA_GEMM=staged` puts it where
    /// `gemm_mma` would run).
    pub gemm_staged: [CudaFunction; 6],
    pub splitk_reduce: CudaFunction,
    pub qkv_post: CudaFunction,
    pub rope_angles: CudaFunction,
    /// Attention for head dimensions up to 128 and up to 256, then up to 128 with 2, 3 and 4 heads of a KV head
    /// a block (`ops::attention_variant`).
    pub attention: [CudaFunction; ATTENTION_VARIANTS],
    /// Their block sizes: each kernel's `__launch_bounds__` (kernels.cu ATT_WARPS x 32), read from the compiled
    /// function so a kernel variant (`SPECULA_CUDA_KERNELS_SOURCE`) may choose its own.
    pub attention_threads: [u32; ATTENTION_VARIANTS],
    /// The same attention as a list of (row, head, split) items taken by a grid sized to the GPU (kernels.cu
    /// attention_list), for launches of up to `ops::ATTENTION_LIST_MAX_ROWS` rows.
    pub attention_list: [CudaFunction; ATTENTION_VARIANTS],
    /// Blocks of each list kernel the GPU holds at once (its grid: multiprocessors x blocks each).
    pub attention_list_blocks: [u32; ATTENTION_VARIANTS],
    pub gather_rows: CudaFunction,
    /// Rows copied between addresses listed in a table (a batched head pass's per-sequence rows, one launch).
    pub copy_rows_by_address: CudaFunction,
    /// An EAGLE-3 head pass's embedding, input norms and rotary angles in one launch (head.rs).
    pub head_inputs: CudaFunction,
    /// gather_rows and rms_norm in one launch (an EAGLE-3 head's final norm).
    pub gather_rms_norm: CudaFunction,
    pub chain_next: CudaFunction,
    /// chain_next for every sequence of a batched device chain.
    pub chain_next_rows: CudaFunction,
    pub gather_feature_rows: CudaFunction,
    pub argmax_partial: CudaFunction,
    pub argmax_final: CudaFunction,
    pub gather_columns: CudaFunction,
    pub top_token: CudaFunction,
    pub top_k_log_probs: CudaFunction,
    pub fill_random_bf16: CudaFunction,
    pub kv_keep_rows: CudaFunction,
}

pub struct Gpu {
    /// Launch kernels with programmatic dependent launch (Hopper and newer; `SPECULA_PDL=0` turns it off): a
    /// kernel's blocks start while the previous kernel drains, prefetch their weights, and wait
    /// (griddepcontrol.wait) before touching anything the previous kernel wrote.
    pub pdl: bool,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub kernels: Kernels,
    /// "cuda:0 (NVIDIA H200)".
    pub name: String,
    /// Multiprocessors: how many blocks a launch needs to fill the GPU.
    pub sm_count: usize,
    /// CUDA events the profiler's clocks reuse (a server step marks a few hundred phase edges: creating and
    /// destroying an event for each cost more than recording it).
    pub events: std::sync::Mutex<Vec<cudarc::driver::CudaEvent>>,
    /// While [`Gpu::time_kernels`] runs: every launch bracketed by two events (the flag spares other launches
    /// the lock).
    timing: std::sync::atomic::AtomicBool,
    timed: std::sync::Mutex<Vec<TimedLaunch>>,
}

/// A launch [`Gpu::time_kernels`] timed: the kernel, its grid and the events recorded around it.
struct TimedLaunch {
    kernel: String,
    grid: (u32, u32, u32),
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
}

/// NVRTC's name for an architecture, e.g. "sm_90" (NVRTC wants a static string).
fn arch_name(major: i32, minor: i32) -> Result<&'static str> {
    Ok(match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ if major < 8 => {
            return Err(Error::Cuda(format!(
            "compute capability {major}.{minor}: specula's GPU kernels need 8.0 (Ampere) or newer \
                 (bf16 tensor-core instructions)"
        )))
        }
        _ => {
            return Err(Error::Cuda(format!(
                "compute capability {major}.{minor} is not one specula compiles for (8.0-12.0)"
            )))
        }
    })
}

/// Compiles kernels.cu to PTX for `arch` (e.g. "sm_90"). Needs only NVRTC, no GPU: the test suite runs it where
/// NVRTC is installed, so a kernel that does not compile fails a test.
pub fn compile_kernels(arch: &'static str) -> Result<cudarc::nvrtc::Ptx> {
    check_library_present("NVRTC (libnvrtc.so)", || unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    })?;
    // Kernel work on the device: `SPECULA_CUDA_KERNELS_SOURCE=FILE` compiles a variant of kernels.cu instead of
    // the built-in one (same kernel names and arguments), so variants can be compared with one binary.
    let source: std::borrow::Cow<'static, str> = match std::env::var_os(
        "SPECULA_CUDA_KERNELS_SOURCE",
    ) {
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                Error::Cuda(format!(
                    "reading SPECULA_CUDA_KERNELS_SOURCE {}: {e}",
                    std::path::Path::new(&path).display()
                ))
            })?;
            eprintln!(
                "kernels: compiling {} (SPECULA_CUDA_KERNELS_SOURCE) instead of the built-in kernels.cu",
                std::path::Path::new(&path).display()
            );
            text.into()
        }
        None => KERNELS_SOURCE.into(),
    };
    compile_ptx_with_opts(
        source,
        CompileOptions {
            arch: Some(arch),
            options: vec!["--std=c++17".into()],
            ..Default::default()
        },
    )
    .map_err(|e| Error::Cuda(format!("compiling kernels.cu for {arch} with NVRTC: {e}")))
}

/// Whether NVRTC can be loaded here (the test suite compiles the kernels when it can).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn check_library_present(what: &str, present: impl FnOnce() -> bool) -> Result<()> {
    if present() {
        Ok(())
    } else {
        Err(Error::Cuda(format!(
            "{what} could not be loaded: this machine has no NVIDIA driver or CUDA runtime library where the \
             loader looks (set LD_LIBRARY_PATH, e.g. to /usr/local/cuda/lib64); --device cpu runs without one"
        )))
    }
}

impl Gpu {
    /// Opens GPU `index` and compiles the kernels for it.
    pub fn open(index: usize) -> Result<Self> {
        check_library_present("The CUDA driver (libcuda.so.1)", || unsafe {
            cudarc::driver::sys::is_culib_present()
        })?;
        let count = CudaContext::device_count().map_err(|e| cuda_err("counting GPUs", e))?;
        if index >= count.max(0) as usize {
            return Err(Error::InvalidArgument(format!(
                "--device cuda:{index}: this machine has {count} GPU{}",
                if count == 1 { "" } else { "s" }
            )));
        }
        let ctx = CudaContext::new(index).map_err(|e| cuda_err("opening the GPU", e))?;
        // Every buffer is used on one stream; cudarc's per-allocation events would also break graph capture.
        // SAFETY: no buffer exists yet, and all work goes to the one stream below.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx);
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda_err("reading the compute capability", e))?;
        let ptx = compile_kernels(arch_name(major, minor)?)?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| cuda_err("loading the compiled kernels", e))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda_err(&format!("finding kernel {name}"), e))
        };
        let threads = |name: &str| -> Result<u32> {
            let t = f(name)?
                .max_threads_per_block()
                .map_err(|e| cuda_err(&format!("reading kernel {name}'s block size"), e))?;
            if t < 32 || t % 32 != 0 {
                return Err(Error::Cuda(format!(
                    "kernel {name} allows blocks of {t} threads; it needs whole warps"
                )));
            }
            Ok(t as u32)
        };
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| cuda_err("reading the multiprocessor count", e))?
            .max(1) as usize;
        // Blocks of a kernel at its full block size the whole GPU runs at once.
        let resident = |name: &str| -> Result<u32> {
            let kernel = f(name)?;
            let per_sm = kernel
                .occupancy_max_active_blocks_per_multiprocessor(threads(name)?, 0, None)
                .map_err(|e| cuda_err(&format!("reading kernel {name}'s occupancy"), e))?;
            Ok(per_sm.max(1) * sm_count as u32)
        };
        let kernels = Kernels {
            embed_rows: f("embed_rows")?,
            rms_norm: f("rms_norm")?,
            split_rows: f("split_rows")?,
            gemv_mma: [
                f("gemv_mma_8_d4")?,
                f("gemv_mma_8_d2")?,
                f("gemv_mma_16")?,
                f("gemv_mma_32")?,
                f("gemv_mma_24")?,
            ],
            gemv_q4k: [
                f("gemv_q4k_8_d4")?,
                f("gemv_q4k_8_d2")?,
                f("gemv_q4k_16")?,
                f("gemv_q4k_32")?,
                f("gemv_q4k_24")?,
            ],
            gemv_i8: [
                f("gemv_i8_8_d4")?,
                f("gemv_i8_8_d2")?,
                f("gemv_i8_16")?,
                f("gemv_i8_32")?,
                f("gemv_i8_24")?,
            ],
            gemv_mixed: [
                f("gemv_mixed_8_d4")?,
                f("gemv_mixed_8_d2")?,
                f("gemv_mixed_16")?,
                f("gemv_mixed_32")?,
                f("gemv_mixed_24")?,
            ],
            gemm_mma: [f("gemm_mma_32")?, f("gemm_mma_64")?],
            gemm_staged: [
                f("gemm_staged_32")?,
                f("gemm_staged")?,
                f("gemm_staged_q4k_32")?,
                f("gemm_staged_q4k")?,
                f("gemm_staged_i8_32")?,
                f("gemm_staged_i8")?,
            ],
            splitk_reduce: f("splitk_reduce")?,
            qkv_post: f("qkv_post")?,
            rope_angles: f("rope_angles")?,
            attention: by_variant(ATTENTION_GRID, f)?,
            attention_threads: by_variant(ATTENTION_GRID, threads)?,
            attention_list: by_variant(ATTENTION_LIST, f)?,
            attention_list_blocks: by_variant(ATTENTION_LIST, resident)?,
            gather_rows: f("gather_rows")?,
            head_inputs: f("head_inputs")?,
            gather_rms_norm: f("gather_rms_norm")?,
            chain_next: f("chain_next")?,
            chain_next_rows: f("chain_next_rows")?,
            gather_feature_rows: f("gather_feature_rows")?,
            copy_rows_by_address: f("copy_rows_by_address")?,
            argmax_partial: f("argmax_partial")?,
            argmax_final: f("argmax_final")?,
            gather_columns: f("gather_columns")?,
            top_token: f("top_token")?,
            top_k_log_probs: f("top_k_log_probs")?,
            fill_random_bf16: f("fill_random_bf16")?,
            kv_keep_rows: f("kv_keep_rows")?,
            _module: module,
        };
        let card = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let pdl = major >= 9 && std::env::var("SPECULA_PDL").map_or(true, |v| v != "0");
        Ok(Gpu {
            pdl,
            name: format!("cuda:{index} ({card})"),
            sm_count,
            ctx,
            stream,
            kernels,
            events: Default::default(),
            timing: Default::default(),
            timed: Default::default(),
        })
    }

    /// Runs `work` with CUDA graphs suspended and every kernel launch bracketed by CUDA events, and returns each
    /// launch's device time in launch order. Each kernel then runs alone (no graph, nothing overlapping it), so a
    /// time is that kernel's own plus the gap an event leaves: the sum exceeds what the graphed work costs, and
    /// the list says where it goes. For diagnosis (`specula selftest --device cuda`), never in a step.
    pub fn time_kernels(
        &self,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<crate::profile::KernelTime>> {
        use std::sync::atomic::Ordering::SeqCst;
        let poisoned = |_| Error::Cuda("the kernel timer's lock is poisoned".into());
        self.timed.lock().map_err(poisoned)?.clear();
        super::model::suspend_graphs(true);
        self.timing.store(true, SeqCst);
        let ran = work();
        self.timing.store(false, SeqCst);
        super::model::suspend_graphs(false);
        let launches = std::mem::take(&mut *self.timed.lock().map_err(poisoned)?);
        ran?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("waiting for the timed kernels", e))?;
        launches
            .iter()
            .map(|l| {
                let ms = l
                    .start
                    .elapsed_ms(&l.end)
                    .map_err(|e| cuda_err("reading a kernel's events", e))?;
                Ok(crate::profile::KernelTime {
                    kernel: l.kernel.clone(),
                    grid: l.grid,
                    us: f64::from(ms) * 1e3,
                })
            })
            .collect()
    }

    /// Launches `f` on the step stream with `params` (pointers to each argument's value, in order), with
    /// programmatic dependent launch when `self.pdl`. Every kernel in kernels.cu calls pdl_wait() before it reads
    /// or writes memory another kernel touches, so the attribute never changes a result.
    ///
    /// # Safety
    /// `params` must match `f`'s parameters in number, order and type, and every pointer argument must be a live
    /// device allocation of the size the kernel indexes.
    pub unsafe fn launch(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        if !self.timing.load(std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: as this function's.
            return unsafe { self.launch_untimed(f, name, grid, block, params) };
        }
        let event = || {
            self.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("creating a kernel timer's event", e))
        };
        let (start, end) = (event()?, event()?);
        start
            .record(&self.stream)
            .map_err(|e| cuda_err("recording a kernel timer's event", e))?;
        // SAFETY: as this function's.
        unsafe { self.launch_untimed(f, name, grid, block, params) }?;
        end.record(&self.stream)
            .map_err(|e| cuda_err("recording a kernel timer's event", e))?;
        self.timed
            .lock()
            .map_err(|_| Error::Cuda("the kernel timer's lock is poisoned".into()))?
            .push(TimedLaunch {
                kernel: name.to_string(),
                grid,
                start,
                end,
            });
        Ok(())
    }

    /// [`Gpu::launch`] without the kernel timer's check.
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch_untimed(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the GPU context", e))?;
        // SAFETY: an all-zero attribute value is valid; the field set below is the one the id names.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: the caller guarantees the parameters; the config and attribute outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| cuda_err(name, e))
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| cuda_err("reading free memory", e))
    }
}

/// Buffers come from the device's default memory pool (cudarc allocates stream-ordered), which by default hands
/// memory it holds back to the driver at every synchronization, so each new request's KV caches (and an EAGLE-3
/// head's) were fresh mappings while the engine, which synchronizes every step, waited. Freed memory now stays in
/// the pool for the next request. Best effort: without a pool (no stream-ordered allocation) nothing changes.
fn keep_freed_memory(ctx: &Arc<CudaContext>) {
    use cudarc::driver::sys;
    if !ctx.has_async_alloc() || ctx.bind_to_thread().is_err() {
        return;
    }
    // SAFETY: the pool handle is written by the driver for this context's device; the attribute takes a u64.
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) != sys::CUresult::CUDA_SUCCESS
        {
            return;
        }
        let mut threshold: u64 = u64::MAX;
        let _ = sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        );
    }
}
