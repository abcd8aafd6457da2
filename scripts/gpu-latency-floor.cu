// How much of a small model's decode step is the cost of running kernels one after another, and how much would a
// persistent kernel (grid barriers instead of kernel boundaries) save? A probe for issue 12's 900 tok/s goal,
// built and run on the device by scripts/gpu-latency-floor.sh; no part of specula.
//
// It streams the byte sizes of a qwen2.5-1.5b-shape layer's phases (bf16: QKV, output, gate/up, down, and the
// small kernels between them as zero-byte phases), 28 layers, three ways:
//   kernels:    one kernel a phase, programmatic dependent launch, the whole step captured in a CUDA graph;
//   persistent: one cooperative kernel for the step, a grid barrier between phases;
//   prefetch:   the same, each block asking L2 for its first lines of the next phase before the barrier.
// Each phase reads its own buffer (the step's buffers total ~3 GB, far past the 60 MB L2, so reads come from
// memory as a real step's weights do). Also the bare costs: an empty kernel in a graph, an empty barrier.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <string>
#include <vector>

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        cudaError_t e = (x);                                                                       \
        if (e != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

namespace cg = cooperative_groups;

__device__ float sink;

// Every thread of the grid reads 16-byte words of `p` (n of them) in a grid-stride loop; the sum goes nowhere
// unless it is impossible, so the loads stay.
__device__ __forceinline__ void stream(const uint4* __restrict__ p, size_t n, unsigned tid, unsigned threads) {
    unsigned acc = 0;
    size_t i = tid;
    for (; i + 3 * threads < n; i += 4 * threads) {
        uint4 a = __ldg(p + i), b = __ldg(p + i + threads), c = __ldg(p + i + 2 * threads),
              d = __ldg(p + i + 3 * threads);
        acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < n; i += threads) acc ^= __ldg(p + i).x;
    if (acc == 0x9e3779b9u) sink = (float)acc;
}

__global__ void phase_kernel(const uint4* __restrict__ p, size_t n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stream(p, n, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

// The GEMV's memory pattern without its arithmetic: block b reads its own contiguous run of `per_block` 1 KiB
// tiles (a row block's), warp w tiles w, w + 4, ... in groups of DEPTH, each lane 2 x 16 bytes of a tile.
template <int DEPTH>
__global__ void blocked_kernel(const uint4* __restrict__ p, int per_block, int blocks) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if ((int)blockIdx.x >= blocks) return;
    const uint4* tiles = p + (size_t)blockIdx.x * per_block * 64;
    unsigned acc = 0;
    for (int base = warp; base < per_block; base += DEPTH * 4) {
        uint4 r[DEPTH][2];
#pragma unroll
        for (int j = 0; j < DEPTH; j++) {
            const int c = base + j * 4;
            if (c < per_block) {
                r[j][0] = __ldg(tiles + (size_t)c * 64 + lane);
                r[j][1] = __ldg(tiles + (size_t)c * 64 + lane + 32);
            } else {
                r[j][0] = r[j][1] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int j = 0; j < DEPTH; j++) acc ^= r[j][0].x ^ r[j][1].y;
    }
    if (acc == 0x9e3779b9u) sink = (float)acc;
}

// The same blocks and tiles with the tiles stored chunk-major (tile (block, c) at c * blocks + block): blocks
// that run together read neighbouring tiles.
template <int DEPTH>
__global__ void chunk_major_kernel(const uint4* __restrict__ p, int per_block, int blocks) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if ((int)blockIdx.x >= blocks) return;
    unsigned acc = 0;
    for (int base = warp; base < per_block; base += DEPTH * 4) {
        uint4 r[DEPTH][2];
#pragma unroll
        for (int j = 0; j < DEPTH; j++) {
            const int c = base + j * 4;
            if (c < per_block) {
                const uint4* tile = p + ((size_t)c * blocks + blockIdx.x) * 64;
                r[j][0] = __ldg(tile + lane);
                r[j][1] = __ldg(tile + lane + 32);
            } else {
                r[j][0] = r[j][1] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int j = 0; j < DEPTH; j++) acc ^= r[j][0].x ^ r[j][1].y;
    }
    if (acc == 0x9e3779b9u) sink = (float)acc;
}

// The row-block-major pattern with fewer, longer-lived blocks: block b takes row blocks b, b + grid, ...
template <int DEPTH>
__global__ void looping_kernel(const uint4* __restrict__ p, int per_block, int blocks) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned acc = 0;
    for (int rb = blockIdx.x; rb < blocks; rb += gridDim.x) {
        const uint4* tiles = p + (size_t)rb * per_block * 64;
        for (int base = warp; base < per_block; base += DEPTH * 4) {
            uint4 r[DEPTH][2];
#pragma unroll
            for (int j = 0; j < DEPTH; j++) {
                const int c = base + j * 4;
                if (c < per_block) {
                    r[j][0] = __ldg(tiles + (size_t)c * 64 + lane);
                    r[j][1] = __ldg(tiles + (size_t)c * 64 + lane + 32);
                } else {
                    r[j][0] = r[j][1] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int j = 0; j < DEPTH; j++) acc ^= r[j][0].x ^ r[j][1].y;
        }
        __syncthreads();  // the GEMV's per-row-block reduction point
    }
    if (acc == 0x9e3779b9u) sink = (float)acc;
}

struct Phases {
    const uint4* const* ptr;
    const size_t* words;
    int count;
};

__global__ void persistent_kernel(Phases ph, int prefetch) {
    cg::grid_group grid = cg::this_grid();
    const unsigned tid = blockIdx.x * blockDim.x + threadIdx.x, threads = gridDim.x * blockDim.x;
    for (int i = 0; i < ph.count; i++) {
        stream(ph.ptr[i], ph.words[i], tid, threads);
        if (prefetch && i + 1 < ph.count && ph.words[i + 1] > 0) {
            // Each thread asks for one 128-byte line of the next phase's first stretch.
            size_t line = (size_t)tid * 8;
            if (line < ph.words[i + 1])
                asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(ph.ptr[i + 1] + line)));
        }
        grid.sync();
    }
}

__global__ void empty_kernel() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__global__ void barrier_kernel(int n) {
    cg::grid_group grid = cg::this_grid();
    for (int i = 0; i < n; i++) grid.sync();
}

static float time_graph(cudaGraphExec_t exec, cudaStream_t s, int reps) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms / reps;
}

int main(int argc, char** argv) {
    const int layers = argc > 1 ? atoi(argv[1]) : 28;
    const int threads = 256;
    int dev = 0, sms = 0, per_sm = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Phase sizes of one qwen2.5-1.5b layer as bf16 (hidden 1536, kv 256, ff 8960), in bytes: norm, QKV,
    // qkv_post, attention, output, norm, gate/up, down.
    const double mb = 1 << 20;
    // With "8b" as the second argument, a llama-3.1-8b layer (hidden 4096, kv 1024, ff 14336).
    const bool big = argc > 2 && std::string(argv[2]) == "8b";
    const size_t hd = big ? 4096 : 1536, qkv = big ? 6144 : 2048, ff = big ? 14336 : 8960;
    const size_t layer_bytes[8] = {0, hd * qkv * 2, 0, 0, hd * hd * 2, 0, 2 * ff * hd * 2, ff * hd * 2};
    // Tiles a GEMV block reads, as the GEMV splits these shapes on 132 multiprocessors (layout.rs splits_for).
    const int tiles_qkv = big ? 64 : 16, tiles_out = big ? 43 : 16, tiles_gate_up = big ? 128 : 48,
              tiles_down = big ? 150 : 47;
    std::vector<const uint4*> ptrs;
    std::vector<size_t> words;
    size_t total = 0;
    for (int l = 0; l < layers; l++)
        for (int p = 0; p < 8; p++) {
            uint4* buf = nullptr;
            if (layer_bytes[p]) {
                CHECK(cudaMalloc(&buf, layer_bytes[p]));
                CHECK(cudaMemset(buf, 1, layer_bytes[p]));
            }
            ptrs.push_back(buf);
            words.push_back(layer_bytes[p] / 16);
            total += layer_bytes[p];
        }
    const int phases = (int)ptrs.size();
    printf("device SMs %d; %d layers, %d phases, %.1f MB streamed a step\n", sms, layers, phases, total / mb);

    // 1. One kernel a phase, PDL, captured in a graph. Grid: 4 blocks of 256 a multiprocessor.
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    for (int pdl = 0; pdl < 2; pdl++) {
        for (int per = 1; per <= 4; per *= 2) {
            cudaGraph_t g;
            cudaGraphExec_t exec;
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < phases; i++) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(sms * per);
                cfg.blockDim = dim3(threads);
                cfg.stream = s;
                cfg.attrs = pdl ? &attr : nullptr;
                cfg.numAttrs = pdl ? 1 : 0;
                CHECK(cudaLaunchKernelEx(&cfg, phase_kernel, ptrs[i] ? ptrs[i] : ptrs[1], words[i]));
            }
            CHECK(cudaStreamEndCapture(s, &g));
            CHECK(cudaGraphInstantiate(&exec, g, 0));
            float ms = time_graph(exec, s, 20);
            printf("kernels  pdl=%d blocks/SM=%d: %.3f ms a step (%.0f tok/s), %.2f TB/s\n", pdl, per, ms,
                   1000 / ms, total / (ms * 1e9));
            CHECK(cudaGraphExecDestroy(exec));
            CHECK(cudaGraphDestroy(g));
        }
    }

    // 1b. Each phase size alone: the layers' copies of one phase, back to back (PDL, graph, 4 blocks/SM).
    const char* names[8] = {"norm", "QKV", "qkv_post", "attention", "output", "norm", "gate/up", "down"};
    for (int p : {1, 4, 6, 7}) {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int l = 0; l < layers; l++) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(sms * 4);
            cfg.blockDim = dim3(threads);
            cfg.stream = s;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            CHECK(cudaLaunchKernelEx(&cfg, phase_kernel, ptrs[l * 8 + p], words[l * 8 + p]));
        }
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&exec, g, 0));
        float ms = time_graph(exec, s, 20);
        printf("%-9s %6.2f MB alone: %.2f us a kernel, %.2f TB/s\n", names[p], layer_bytes[p] / mb,
               ms * 1000 / layers, layer_bytes[p] * layers / (ms * 1e9));
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(g));
    }

    // 1c. The same phases with the GEMV's pattern (a block a 16-row block of 1536 inputs: 48 tiles).
    for (int depth : {2, 4, 14, 24}) {
        for (int p : {1, 4, 6, 7}) {
            // As the GEMV splits them: QKV and output 3 ways (16 tiles), down 6 ways (47), gate/up whole (48).
            const int per_block = p == 7 ? tiles_down : (p == 6 ? tiles_gate_up : (p == 4 ? tiles_out : tiles_qkv));
            const int blocks = (int)(layer_bytes[p] / 1024 / per_block);
            cudaGraph_t g;
            cudaGraphExec_t exec;
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            for (int l = 0; l < layers; l++) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(blocks);
                cfg.blockDim = dim3(128);
                cfg.stream = s;
                cfg.attrs = &attr;
                cfg.numAttrs = 1;
                // 14 and 24: chunk-major tiles at depth 4 and 2.
                if (depth == 2)
                    CHECK(cudaLaunchKernelEx(&cfg, blocked_kernel<2>, ptrs[l * 8 + p], per_block, blocks));
                else if (depth == 4)
                    CHECK(cudaLaunchKernelEx(&cfg, blocked_kernel<4>, ptrs[l * 8 + p], per_block, blocks));
                else if (depth == 14)
                    CHECK(cudaLaunchKernelEx(&cfg, chunk_major_kernel<4>, ptrs[l * 8 + p], per_block, blocks));
                else
                    CHECK(cudaLaunchKernelEx(&cfg, chunk_major_kernel<2>, ptrs[l * 8 + p], per_block, blocks));
            }
            CHECK(cudaStreamEndCapture(s, &g));
            CHECK(cudaGraphInstantiate(&exec, g, 0));
            float ms = time_graph(exec, s, 20);
            printf("%-9s GEMV pattern %s depth %d, %d blocks of %d tiles: %.2f us a kernel, %.2f TB/s\n", names[p],
                   depth > 10 ? "chunk-major" : "row-block-major", depth == 24 ? 2 : depth % 10, blocks, per_block, ms * 1000 / layers, layer_bytes[p] * layers / (ms * 1e9));
            CHECK(cudaGraphExecDestroy(exec));
            CHECK(cudaGraphDestroy(g));
        }
    }

    // 1d. Gate/up and down with fewer blocks, each looping over row blocks (depth 4).
    for (int p : {6, 7}) {
        const int per_block = p == 7 ? tiles_down : tiles_gate_up;
        const int blocks = (int)(layer_bytes[p] / 1024 / per_block);
        for (int per_sm : {2, 4, 6, 8, 12}) {
            const int grid = std::min(blocks, sms * per_sm);
            cudaGraph_t g;
            cudaGraphExec_t exec;
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            for (int l = 0; l < layers; l++) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(grid);
                cfg.blockDim = dim3(128);
                cfg.stream = s;
                cfg.attrs = &attr;
                cfg.numAttrs = 1;
                CHECK(cudaLaunchKernelEx(&cfg, looping_kernel<4>, ptrs[l * 8 + p], per_block, blocks));
            }
            CHECK(cudaStreamEndCapture(s, &g));
            CHECK(cudaGraphInstantiate(&exec, g, 0));
            float ms = time_graph(exec, s, 20);
            printf("%-9s looping, %d blocks over %d row blocks: %.2f us a kernel, %.2f TB/s\n", names[p], grid, blocks,
                   ms * 1000 / layers, layer_bytes[p] * layers / (ms * 1e9));
            CHECK(cudaGraphExecDestroy(exec));
            CHECK(cudaGraphDestroy(g));
        }
    }

    // 2. One persistent cooperative kernel, a grid barrier between phases.
    const uint4** d_ptrs;
    size_t* d_words;
    CHECK(cudaMalloc(&d_ptrs, phases * sizeof(void*)));
    CHECK(cudaMalloc(&d_words, phases * sizeof(size_t)));
    CHECK(cudaMemcpy(d_ptrs, ptrs.data(), phases * sizeof(void*), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_words, words.data(), phases * sizeof(size_t), cudaMemcpyHostToDevice));
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, threads, 0));
    for (int prefetch = 0; prefetch < 2; prefetch++)
        for (int per = 1; per <= per_sm && per <= 4; per *= 2) {
            Phases ph{d_ptrs, d_words, phases};
            void* args[] = {&ph, &prefetch};
            cudaEvent_t a, b;
            CHECK(cudaEventCreate(&a));
            CHECK(cudaEventCreate(&b));
            for (int i = 0; i < 3; i++)
                CHECK(cudaLaunchCooperativeKernel((void*)persistent_kernel, sms * per, threads, args, 0, s));
            CHECK(cudaEventRecord(a, s));
            const int reps = 20;
            for (int i = 0; i < reps; i++)
                CHECK(cudaLaunchCooperativeKernel((void*)persistent_kernel, sms * per, threads, args, 0, s));
            CHECK(cudaEventRecord(b, s));
            CHECK(cudaEventSynchronize(b));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, a, b));
            ms /= reps;
            printf("persistent prefetch=%d blocks/SM=%d: %.3f ms a step (%.0f tok/s), %.2f TB/s\n", prefetch, per, ms,
                   1000 / ms, total / (ms * 1e9));
        }

    // 3. Bare costs: an empty PDL kernel in a graph, and an empty grid barrier.
    {
        const int n = 1000;
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < n; i++) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(sms);
            cfg.blockDim = dim3(threads);
            cfg.stream = s;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            CHECK(cudaLaunchKernelEx(&cfg, empty_kernel));
        }
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&exec, g, 0));
        float ms = time_graph(exec, s, 5);
        printf("empty PDL kernel in a graph (%d blocks): %.2f us each\n", sms, ms * 1000 / n);
        int nb = 1000;
        void* args[] = {&nb};
        cudaEvent_t a, b;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&b));
        CHECK(cudaLaunchCooperativeKernel((void*)barrier_kernel, sms, threads, args, 0, s));
        CHECK(cudaEventRecord(a, s));
        CHECK(cudaLaunchCooperativeKernel((void*)barrier_kernel, sms, threads, args, 0, s));
        CHECK(cudaEventRecord(b, s));
        CHECK(cudaEventSynchronize(b));
        CHECK(cudaEventElapsedTime(&ms, a, b));
        printf("empty grid barrier (%d blocks): %.2f us each\n", sms, ms * 1000 / nb);
    }
    CHECK(cudaGetLastError());
    return 0;
}
