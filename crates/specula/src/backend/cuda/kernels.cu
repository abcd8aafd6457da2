// specula's CUDA kernels, compiled at model load by NVRTC (backend/cuda/context.rs) for the card's architecture.
//
// Conventions: activations and the KV cache are f32; weight matrices are bf16 (row-major, one row per output
// column), norms f32. Every reduction has a fixed order that does not depend on how many rows a launch has, so a
// row's result is bitwise the same in a k+1-row verify pass as in a one-row step (batch invariance: what keeps
// greedy speculation lossless).

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
    // A fixed butterfly: every lane ends with the same sum, in the same order whatever the launch.
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Programmatic dependent launch (Hopper and newer; backend/cuda/context.rs Gpu::launch): a kernel may start while
// the previous one drains. pdl_wait() blocks until every earlier kernel has finished and its writes are visible;
// every kernel calls it before touching memory another kernel reads or writes (and before exiting, so that
// waiting on a kernel means waiting on all before it). pdl_trigger() lets the next kernel start launching. Both
// are no-ops when the launch did not ask for it, and compile to nothing before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define PDL_ENTER() \
    pdl_wait();     \
    pdl_trigger()

// The step's view of each row: which sequence, which cache slot, which slot its new rows start at, and (trees)
// which new rows it sees.
struct RowInfo {
    u32 seq;
    u32 slot;
    u32 base;
    u32 is_tree;    // 0: a chain (sees every slot up to its own)
    u64 tree_mask;  // trees: bit j set when the row sees new row j (its ancestors and itself)
};

// A sequence's cache: keys and values of layer l, KV head h, slot s, dim d at
// base[((l * 2 + kind) * kv_heads + h) * capacity + s) * hd + d], kind 0 = keys, 1 = values.
struct SeqCache {
    float* base;
    u32 capacity;
    u32 pad;
};

// Where element (row, col) of a tiled matrix with `chunks` chunks per row block lives (backend/cuda/layout.rs
// tiled_index).
__device__ __forceinline__ size_t tiled_index(u32 row, u32 col, u32 chunks) {
    const u32 block = row >> 4, i = row & 15, chunk = col >> 5, c = col & 31;
    const u32 step = c >> 4, kk = c & 15;
    const u32 reg = (i >> 3) + 2 * (kk >> 3);
    const u32 lane = (i & 7) * 4 + ((kk & 7) >> 1);
    return ((size_t)block * chunks + chunk) * 512 + step * 256 + lane * 8 + reg * 2 + (kk & 1);
}

// Two floats as a bf16 pair, round to nearest even (first in the low half, the lower k index).
__device__ __forceinline__ u32 pack_bf16x2(float first, float second) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
    return r;
}

// The hi and lo bf16 pairs of two consecutive inputs.
__device__ __forceinline__ void split_pair(float2 v, u32& hi, u32& lo) {
    hi = pack_bf16x2(v.x, v.y);
    const float hx = __uint_as_float(hi << 16), hy = __uint_as_float(hi & 0xffff0000u);
    lo = pack_bf16x2(v.x - hx, v.y - hy);
}

// Every GEMV reads its activations "split": each input x as the bf16 pair hi = round(x), lo = round(x - hi),
// already in the order of the mma's B fragments, written once by the kernel that produces them (rms_norm,
// attention, the gate/up GEMV's SiLU, split_rows) instead of by every warp of every row block that reads them.
// Token r's inputs col, col + 1 (col even) of chunk c = col / 32 sit in the 16-byte piece
// xs[((r / 8) * chunks + c) * 2 + h][lane], lane = 4 * (r % 8) + t, where col % 32 = 2t + 8q, h = q / 2, as
// (hi of q = 2h, hi of q = 2h + 1, lo of q = 2h, lo of q = 2h + 1) (backend/cuda/layout.rs split_index). Inputs
// past k stay zero: split buffers are zeroed when allocated and nothing writes there.
__device__ __forceinline__ void store_split_pair(u32* __restrict__ xs, int chunks, int token, int col, float a, float b) {
    u32 hi, lo;
    split_pair(make_float2(a, b), hi, lo);
    const int c = col >> 5, cc = col & 31, t = (cc & 7) >> 1, q = cc >> 3;
    const int lane = (token & 7) * 4 + t;
    const size_t at = ((((size_t)(token >> 3) * chunks + c) * 2 + (q >> 1)) * 32 + lane) * 4 + (q & 1);
    xs[at] = hi;
    xs[at + 2] = lo;
}

// xs = split(x) for m rows of k f32 inputs (k even); grid (m), block 256.
extern "C" __global__ void split_rows(const float* __restrict__ x, u32* __restrict__ xs, int k, int chunks) {
    PDL_ENTER();
    const int r = blockIdx.x;
    const float2* xr = reinterpret_cast<const float2*>(x + (size_t)r * k);
    for (int i = threadIdx.x; i < (k >> 1); i += blockDim.x) {
        const float2 v = xr[i];
        store_split_pair(xs, chunks, r, 2 * i, v.x, v.y);
    }
}

// out[r][i] = table[tokens[r]][i], bf16 -> f32, from the tiled embedding (which the tied LM head's GEMV reads).
// grid (rows), block 256.
extern "C" __global__ void embed_rows(const bf16_t* __restrict__ table, const u32* __restrict__ tokens,
                                      float* __restrict__ out, int h, int chunks) {
    PDL_ENTER();
    const int r = blockIdx.x;
    const u32 token = tokens[r];
    for (int i = threadIdx.x; i < h; i += blockDim.x)
        out[(size_t)r * h + i] = bf16_to_f32(table[tiled_index(token, i, chunks)]);
}

// Split-K partitions a GEMV has at most (layout.rs MAX_SPLITS).
#define SPLITK_MAX 8

// 0 + p[0] + p[stride] + ... over `splits` partial sums, in split order, every load issued before the first add
// (a loop adding as it loads waits out one L2 round trip a split).
__device__ __forceinline__ float ordered_split_sum(const float* __restrict__ p, int splits, u64 stride) {
    float v[SPLITK_MAX];
#pragma unroll
    for (int z = 0; z < SPLITK_MAX; z++) v[z] = z < splits ? p[z * stride] : 0.f;
    float s = 0.f;
#pragma unroll
    for (int z = 0; z < SPLITK_MAX; z++)
        if (z < splits) s += v[z];
    return s;
}

// The sum of a GEMV output's split-K partial sums in split order (splitk_reduce's order), or the output itself.
__device__ __forceinline__ float split_sum(const float* __restrict__ p, int splits, u64 stride, size_t i) {
    if (splits <= 1) return p[i];
    return ordered_split_sum(p + i, splits, stride);
}

// out[r] = x[r] * w / sqrt(mean(x[r]^2) + eps), written split for the GEMV that reads it (out_chunks = ceil(h /
// 32)), for h % 4 == 0, h <= 16384; grid (rows), block ops.rs norm_threads(h) (a thread for each 16-byte piece
// of the row, at most 1024, which then take up to 4 pieces each). Each thread loads its pieces of the row at once
// and keeps them in registers; threads sum their pieces in order, warps reduce by butterfly, warp 0 sums the warp
// totals in order: a fixed order for a given h.
#define NORM_PIECES 4

// v += a deferred split-K residual update of row `row` (partials[z][row] for z < splits, added in split order as
// splitk_reduce would: every split's piece loaded at once, then added), written back to that row of x (xw).
__device__ __forceinline__ void add_split_residual(float4 (&v)[NORM_PIECES], float4* __restrict__ xw,
                                                   const float* __restrict__ partials, int splits,
                                                   u64 split_stride, size_t row, int h) {
    const int pieces = h >> 2;
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < pieces) {
            float4 pz[SPLITK_MAX];
#pragma unroll
            for (int z = 0; z < SPLITK_MAX; z++)
                pz[z] = z < splits ? reinterpret_cast<const float4*>(partials + z * split_stride + row * h)[i]
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
            float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int z = 0; z < SPLITK_MAX; z++) {
                if (z < splits) {
                    t.x += pz[z].x; t.y += pz[z].y; t.z += pz[z].z; t.w += pz[z].w;
                }
            }
            v[j] = make_float4(v[j].x + t.x, v[j].y + t.y, v[j].z + t.z, v[j].w + t.w);
            xw[i] = v[j];
        }
    }
}

// With splits > 0 it first adds a deferred split-K residual update (the output or down projection's partial sums,
// partials[z][r] for z < splits, summed in split order as splitk_reduce would) into x and writes x back: one
// launch instead of a reduction kernel and a norm.
// With copy_out set it also writes the row of x it normalized (after that addition) there: a captured layer's
// output for an EAGLE-3 head, without a copy in the graph (a memcpy node also breaks the chain of programmatic
// launches) and without finishing the down projection's split-K in place for it.
extern "C" __global__ void __launch_bounds__(1024) rms_norm(float* __restrict__ x, const float* __restrict__ w,
                                                            u32* __restrict__ out, int h, float eps,
                                                            const float* __restrict__ partials, int splits,
                                                            u64 split_stride, int out_chunks,
                                                            float* __restrict__ copy_out) {
    __shared__ float partial[32];
    const int r = blockIdx.x;
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * h);
    const int pieces = h >> 2;
    // The weights never come from a kernel: load them while the previous kernel drains.
    const float4* wr = reinterpret_cast<const float4*>(w);
    float4 g[NORM_PIECES];
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        g[j] = i < pieces ? wr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    PDL_ENTER();
    float4 v[NORM_PIECES];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j] = i < pieces ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (splits > 0) {
        // add_split_residual's steps inline: the target's hot path stays what ran on a device until the helper
        // (written for the head's folded kernels) has run there too.
        float4* xw = reinterpret_cast<float4*>(x + (size_t)r * h);
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < pieces) {
                // Every split's piece loaded at once, then added in split order.
                float4 pz[SPLITK_MAX];
#pragma unroll
                for (int z = 0; z < SPLITK_MAX; z++)
                    pz[z] = z < splits ? reinterpret_cast<const float4*>(partials + z * split_stride + (size_t)r * h)[i]
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
                float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int z = 0; z < SPLITK_MAX; z++) {
                    if (z < splits) {
                        t.x += pz[z].x; t.y += pz[z].y; t.z += pz[z].z; t.w += pz[z].w;
                    }
                }
                v[j] = make_float4(v[j].x + t.x, v[j].y + t.y, v[j].z + t.z, v[j].w + t.w);
                xw[i] = v[j];
            }
        }
    }
    if (copy_out != nullptr) {
        float4* cw = reinterpret_cast<float4*>(copy_out + (size_t)r * h);
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < pieces) cw[i] = v[j];
        }
    }
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) s += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    s = warp_sum(s);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) partial[0] = rsqrtf(t / (float)h + eps);
    }
    __syncthreads();
    const float scale = partial[0];
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < pieces) {
            store_split_pair(out, out_chunks, r, 4 * i, v[j].x * scale * g[j].x, v[j].y * scale * g[j].y);
            store_split_pair(out, out_chunks, r, 4 * i + 2, v[j].z * scale * g[j].z, v[j].w * scale * g[j].w);
        }
    }
}

// y[r][c] = dot(x[r], W[c]) for a bf16 W of n rows x k columns in the tiled layout of backend/cuda/layout.rs
// (tiles of 16 rows x 32 columns, 1 KiB each in the order lanes read them), m activation rows of k inputs, split.
// grid (row_blocks, ceil(m / (8 * NT)), splits), block MMA_WARPS * 32: a block owns one row block (16 outputs)
// and 8 * NT activation rows ("tokens"); its split's chunks of 32 inputs are dealt to the warps in turn (warp w
// takes chunks w, w + MMA_WARPS, ... of the split, in order), each warp accumulates its chunks on the tensor cores
// (mma.m16n8k16, bf16 x bf16 -> f32), and warp 0 adds the warps' sums in warp order. Four warps a row block
// (rather than one) keep enough loads in flight when a matrix has few row blocks. An activation comes split into
// bf16 hi + lo (store_split_pair), multiplied by both, so inputs keep ~16 bits of mantissa instead of bf16's 8.
// Each output is a fixed sum of mma accumulator elements; element (row, token) depends only on that row's weights
// and that token's inputs, in an order fixed by the shape, whatever m is or where the token sits in the tile
// (batch invariance).
// Output, by mode:
//   splits > 1: the split's partial sums go to scratch[split][r][c]; the next kernel (or splitk_reduce) adds them
//               up in split order.
//   silu_pairs: row block b holds gate rows 8b..8b+8 then up rows 8b..8b+8; y[r][8b + g] = silu(gate) * up,
//               written split (n / 2 inputs of the next GEMV).
//   otherwise:  y[r][c] = sum, or y[r][c] += sum when accumulate (a residual add).
#define MMA_WARPS 4

__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], const uint4& a, u32 b0, u32 b1) {
    // Not volatile: the result depends only on the operands, so the compiler may schedule loads around it.
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// The SiLU(gate) * up outputs of a gate/up GEMV, written split for the down projection: the lane holding feature
// 8b + g of a token (g even) takes feature 8b + g + 1 from lane + 4 (g + 1, same t) and stores the pair. Every lane
// of the warp must call it (a shuffle), with its own token and value.
__device__ __forceinline__ void store_silu_split(float* __restrict__ y, int n, int m, int token, int feature, int g,
                                                 float va, float vb) {
    const float s = va / (1.f + expf(-va)) * vb;
    const float next = __shfl_down_sync(0xffffffffu, s, 4);
    const int features = n / 2;
    if ((g & 1) == 0 && token < m && feature < features)
        store_split_pair(reinterpret_cast<u32*>(y), (features + 31) >> 5, token, feature, s,
                         feature + 1 < features ? next : 0.f);
}

// One lane's two outputs of a GEMV or GEMM tile for one token: rows 16 * row_block + g and + 8 (g = lane / 4), as
// SiLU(gate) * up pairs split for the down projection, a split-K partial, or y itself (added to where
// accumulating). Every lane must call it (the SiLU store shuffles), tokens past m included.
__device__ __forceinline__ void store_outputs(float* __restrict__ y, float* __restrict__ scratch, int n, int m,
                                              int token, int row_block, int g, float va, float vb, int silu_pairs,
                                              int splits, int accumulate) {
    if (silu_pairs) {
        store_silu_split(y, n, m, token, row_block * 8 + g, g, va, vb);
        return;
    }
    if (token >= m) return;
    const int row_a = row_block * 16 + g, row_b = row_a + 8;
    if (splits > 1) {
        float* dst = scratch + ((size_t)blockIdx.z * m + token) * n;
        if (row_a < n) dst[row_a] = va;
        if (row_b < n) dst[row_b] = vb;
    } else {
        float* dst = y + (size_t)token * n;
        if (row_a < n) dst[row_a] = accumulate ? dst[row_a] + va : va;
        if (row_b < n) dst[row_b] = accumulate ? dst[row_b] + vb : vb;
    }
}

// A lane's two B-fragment pieces of chunk c for the 8-token tile `tile` (zeros for a token past m).
__device__ __forceinline__ void load_split(const uint4* __restrict__ xs, int tile, int chunks, int c, int lane,
                                           bool has_token, uint4& b0, uint4& b1) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const uint4* at = xs + (((size_t)tile * chunks + c) * 2) * 32 + lane;
    b0 = has_token ? at[0] : zero;
    b1 = has_token ? at[32] : zero;
}

// One chunk's four mma's for one token tile: hi then lo of the first k16 step, then of the second.
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4 (&a)[2], const uint4& b0, const uint4& b1) {
    mma_bf16_16x8x16(d, a[0], b0.x, b0.y);
    mma_bf16_16x8x16(d, a[0], b0.z, b0.w);
    mma_bf16_16x8x16(d, a[1], b1.x, b1.y);
    mma_bf16_16x8x16(d, a[1], b1.z, b1.w);
}

// Weight formats the GEMV reads (backend/cuda/layout.rs). Each says how big a tile (16 rows x 32 inputs) is, how
// a lane loads its part of one (load: the raw bytes, issued for several chunks before any is used) and how those
// become the lane's two A fragments of bf16 pairs (expand).
struct Bf16Weights {
    static constexpr int TILE_U4 = 64;  // 1 KiB: the lane's 16 bytes of step 0, then of step 1
    static constexpr int LINES = 8;     // 128-byte lines a tile spans (prefetch)
    struct Raw {
        uint4 a0, a1;
    };
    __device__ static __forceinline__ Raw load(const uint4* __restrict__ tile, int lane) {
        const uint4* at = tile + lane;
        return {__ldg(at), __ldg(at + 32)};
    }
    __device__ static __forceinline__ void expand(const Raw& r, uint4 (&a)[2]) {
        a[0] = r.a0;
        a[1] = r.a1;
    }
};

// Nibble weights, the native format of GGUF Q4_K and Q4_1 (layout.rs tile_q4k, tile_q4_1): 8 bytes of nibbles a
// lane (its 16 values in the bf16 tile's order, low nibble first: byte r of word s is register r of step s), then
// each of the 16 rows' (d1, m1) for the chunk (Q4_K: d * scale, dmin * min of its sub-block; Q4_1: d, -m). Each
// value becomes d1 * q - m1 in f32, rounded at each step (no fused multiply-add: the host's dequantization rounds
// the product), then bf16 round-to-nearest-even: exactly the bf16 the host would have uploaded, so the mma's see
// the same operands and every output is the bf16 GEMV's bits.
struct Q4kWeights {
    static constexpr int TILE_U4 = 24;  // 384 bytes
    static constexpr int LINES = 3;
    struct Raw {
        uint2 q;
        float2 row_a, row_b;  // rows g and g + 8
    };
    __device__ static __forceinline__ Raw load(const uint4* __restrict__ tile, int lane) {
        const uint2* nibbles = reinterpret_cast<const uint2*>(tile);
        const float2* factors = reinterpret_cast<const float2*>(tile + 16);
        const int g = lane >> 2;
        return {__ldg(nibbles + lane), __ldg(factors + g), __ldg(factors + g + 8)};
    }
    __device__ static __forceinline__ u32 pair(const float2& f, u32 byte) {
        const float lo = __fsub_rn(__fmul_rn(f.x, (float)(byte & 15u)), f.y);
        const float hi = __fsub_rn(__fmul_rn(f.x, (float)((byte >> 4) & 15u)), f.y);
        return pack_bf16x2(lo, hi);
    }
    __device__ static __forceinline__ uint4 step(u32 word, const float2& row_a, const float2& row_b) {
        // Registers: a0 row g, a1 row g + 8, a2 row g (columns + 8), a3 row g + 8 (columns + 8).
        return make_uint4(pair(row_a, word & 0xffu), pair(row_b, (word >> 8) & 0xffu), pair(row_a, (word >> 16) & 0xffu),
                          pair(row_b, word >> 24));
    }
    __device__ static __forceinline__ void expand(const Raw& r, uint4 (&a)[2]) {
        a[0] = step(r.q.x, r.row_a, r.row_b);
        a[1] = step(r.q.y, r.row_a, r.row_b);
    }
};

// Scaled int8 weights, the native format of GGUF Q6_K, Q8_0, Q5_0 and Q4_0 (layout.rs tile_q6k, tile_q8_0,
// tile_q5_0, tile_q4_0): each lane's 16 values as signed bytes in the bf16 tile's order (step 0's four registers in words
// x, y; step 1's in z, w), then each row's two factors (inputs 0-15: step 0, 16-31: step 1; Q6_K's d * scale,
// the 32-weight types' d twice). Each value becomes factor * q in f32, then bf16 round-to-nearest-even: the host's
// dequantization, so the same bits as the bf16 GEMV.
struct ScaledI8Weights {
    static constexpr int TILE_U4 = 40;  // 640 bytes
    static constexpr int LINES = 5;
    struct Raw {
        uint4 q;
        float2 row_a, row_b;  // rows g and g + 8: (step 0 factor, step 1 factor)
    };
    __device__ static __forceinline__ Raw load(const uint4* __restrict__ tile, int lane) {
        const float2* factors = reinterpret_cast<const float2*>(tile + 32);
        const int g = lane >> 2;
        return {__ldg(tile + lane), __ldg(factors + g), __ldg(factors + g + 8)};
    }
    __device__ static __forceinline__ u32 pair(float f, u32 bytes) {  // the two signed bytes in bits 0-15
        const float lo = __fmul_rn(f, (float)(signed char)(bytes & 0xffu));
        const float hi = __fmul_rn(f, (float)(signed char)((bytes >> 8) & 0xffu));
        return pack_bf16x2(lo, hi);
    }
    __device__ static __forceinline__ uint4 step(u32 w0, u32 w1, float fa, float fb) {
        // Registers: a0 row g, a1 row g + 8, a2 row g (columns + 8), a3 row g + 8 (columns + 8).
        return make_uint4(pair(fa, w0), pair(fb, w0 >> 16), pair(fa, w1), pair(fb, w1 >> 16));
    }
    __device__ static __forceinline__ void expand(const Raw& r, uint4 (&a)[2]) {
        a[0] = step(r.q.x, r.q.y, r.row_a.x, r.row_b.x);
        a[1] = step(r.q.z, r.q.w, r.row_a.y, r.row_b.y);
    }
};

// NT is the number of 8-token tiles a block takes (1 for decode and verify up to 8 rows, 2 up to 16, 3 up to 24,
// 4 past that:
// the weights are read once per 8 * NT tokens); the arithmetic per (row, token) is the same for every NT. (8 tiles
// a block, at one chunk in flight a warp for want of registers, was slower on an H200: 5.75 ms against 3.71 for a
// 64-row pass of the qwen2.5-1.5b shape.)
// `w` holds the tiles of row blocks `first_block` on (a part of a mixed matrix, or the whole one).
// (A block taking two row blocks, so that a warp's activation loads served two weight tiles, was slower on every
// shape measured: bf16 8-9% at 9-16 rows on an H100, the real Q4_K_M 1.5B's server 3-10% at 8-16 streams on an
// H200; docs/benchmarks.md, sessions 39 and 40. Half the blocks keep fewer loads in flight.)
template <typename W, int NT, int DEPTH>
__device__ __forceinline__ void gemv_mma_tile(const uint4* __restrict__ w, const uint4* __restrict__ xs,
                                              float* __restrict__ y, int n, int k, int chunks, int m, int accumulate,
                                              int splits, float* __restrict__ scratch, int silu_pairs,
                                              int first_block = 0) {
    __shared__ float partial[MMA_WARPS - 1][NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int block = blockIdx.x;
    const int per_split = (chunks + splits - 1) / splits;
    const int c_begin = blockIdx.z * per_split, c_end = min(chunks, c_begin + per_split);
    const uint4* tiles = w + (size_t)(block - first_block) * chunks * W::TILE_U4;
    const bool valid = block * 16 < n;
    {
        // Weights never depend on an earlier kernel: start pulling the warp's first four chunks into L2 (lanes
        // 8j..8j+7 take the 128-byte lines of chunk j) while the previous kernel finishes.
        const int c = c_begin + warp + (lane >> 3) * MMA_WARPS;
        if (valid && c < c_end && (lane & 7) < W::LINES)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(tiles + (size_t)c * W::TILE_U4) + (lane & 7) * 128));
    }
    PDL_ENTER();
    if (!valid) return;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * 8 * NT;
    bool has_token[NT];
#pragma unroll
    for (int u = 0; u < NT; u++) has_token[u] = r0 + 8 * u + g < m;
    float d[NT][4];
#pragma unroll
    for (int u = 0; u < NT; u++) d[u][0] = d[u][1] = d[u][2] = d[u][3] = 0.f;
    // DEPTH chunks at a time: every weight and activation load of the group is issued before the first mma, so
    // DEPTH KiB of weights per warp are in flight (one chunk at a time waited on memory every iteration and
    // streamed at ~30% of bandwidth; DEPTH 8 needed 153 registers a thread and was slower than 4). Chunks past the
    // split's end are neither loaded nor multiplied (c is the same in every lane: the mma stays warp-uniform).
    for (int base = c_begin + warp; base < c_end; base += DEPTH * MMA_WARPS) {
        typename W::Raw raw[DEPTH];
        uint4 b[DEPTH][NT][2];
#pragma unroll
        for (int j = 0; j < DEPTH; j++) {
            const int c = base + j * MMA_WARPS;
            if (c < c_end) {
                raw[j] = W::load(tiles + (size_t)c * W::TILE_U4, lane);
#pragma unroll
                for (int u = 0; u < NT; u++)
                    load_split(xs, blockIdx.y * NT + u, chunks, c, lane, has_token[u], b[j][u][0], b[j][u][1]);
            }
        }
#pragma unroll
        for (int j = 0; j < DEPTH; j++) {
            if (base + j * MMA_WARPS < c_end) {
                uint4 a[2];
                W::expand(raw[j], a);
#pragma unroll
                for (int u = 0; u < NT; u++) mma_chunk(d[u], a, b[j][u][0], b[j][u][1]);
            }
        }
    }
    if (warp > 0) {
#pragma unroll
        for (int u = 0; u < NT; u++)
#pragma unroll
            for (int e = 0; e < 4; e++) partial[warp - 1][u * 4 + e][lane] = d[u][e];
    }
    __syncthreads();
    if (warp != 0) return;
    for (int w = 0; w < MMA_WARPS - 1; w++)
#pragma unroll
        for (int u = 0; u < NT; u++)
#pragma unroll
            for (int e = 0; e < 4; e++) d[u][e] += partial[w][u * 4 + e][lane];
#pragma unroll
    for (int u = 0; u < NT; u++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int token = r0 + 8 * u + 2 * t + e;
            store_outputs(y, scratch, n, m, token, block, g, d[u][e], d[u][2 + e], silu_pairs, splits, accumulate);
        }
    }
}

#define GEMV_MMA_KERNEL(name, W, NT, DEPTH)                                                                     \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                                                 \
        name(const uint4* __restrict__ w, const uint4* __restrict__ xs, float* __restrict__ y, int n, int k,       \
             int chunks, int m, int accumulate, int splits, float* __restrict__ scratch, int silu_pairs) {       \
        gemv_mma_tile<W, NT, DEPTH>(w, xs, y, n, k, chunks, m, accumulate, splits, scratch, silu_pairs);       \
    }
// DEPTH only changes how many chunks' loads are in flight, never which warp sums which chunk, so every variant
// gives the same bits. Measured on an H200 (docs/benchmarks.md): DEPTH 4 streams the large unsplit gate/up
// matrices best (87.8% of DRAM bandwidth against 83.7% at DEPTH 2) and split-K ones of few chunks a warp, DEPTH 2
// split-K ones of many (the 8b shape's down projection 30.5 us against 36.1 us): ops.rs split_depth4_max.
// (Loading a warp's first group of weights into registers before the PDL wait, instead of into L2, lost 8-9% on
// every shape: docs/benchmarks.md, session 30.)
GEMV_MMA_KERNEL(gemv_mma_8_d4, Bf16Weights, 1, 4)
GEMV_MMA_KERNEL(gemv_mma_8_d2, Bf16Weights, 1, 2)
GEMV_MMA_KERNEL(gemv_mma_16, Bf16Weights, 2, 2)
GEMV_MMA_KERNEL(gemv_mma_24, Bf16Weights, 3, 2)
GEMV_MMA_KERNEL(gemv_mma_32, Bf16Weights, 4, 2)
// Native nibble weights (Q4_K, Q4_1; 2.7x fewer bytes than bf16), the same sums bit for bit.
GEMV_MMA_KERNEL(gemv_q4k_8_d4, Q4kWeights, 1, 4)
GEMV_MMA_KERNEL(gemv_q4k_8_d2, Q4kWeights, 1, 2)
GEMV_MMA_KERNEL(gemv_q4k_16, Q4kWeights, 2, 2)
GEMV_MMA_KERNEL(gemv_q4k_24, Q4kWeights, 3, 2)
GEMV_MMA_KERNEL(gemv_q4k_32, Q4kWeights, 4, 2)
// Native scaled-int8 weights (Q6_K, Q8_0, Q5_0, Q4_0; 1.6x fewer bytes than bf16), the same sums bit for bit.
GEMV_MMA_KERNEL(gemv_i8_8_d4, ScaledI8Weights, 1, 4)
GEMV_MMA_KERNEL(gemv_i8_8_d2, ScaledI8Weights, 1, 2)
GEMV_MMA_KERNEL(gemv_i8_16, ScaledI8Weights, 2, 2)
GEMV_MMA_KERNEL(gemv_i8_24, ScaledI8Weights, 3, 2)
GEMV_MMA_KERNEL(gemv_i8_32, ScaledI8Weights, 4, 2)

// A matrix stacked from parts of different formats (Q, K and V of mixed GGUF types): row blocks [0, first1) in
// format f & 3, [first1, first2) in (f >> 2) & 3, [first2, ...) in (f >> 4) & 3 (0 bf16, 1 nibble, 2 scaled int8),
// each part's tiles at its offset (in 16-byte units) into `w`. Every block takes one part's path, so every output
// is that format's kernel's bits, which are the bf16 GEMV's.
template <int NT, int DEPTH>
__device__ __forceinline__ void gemv_mixed_tile(const uint4* __restrict__ w, const uint4* __restrict__ xs,
                                                float* __restrict__ y, int n, int k, int chunks, int m,
                                                int accumulate, int splits, float* __restrict__ scratch,
                                                int silu_pairs, int first1, int first2, u64 offset1, u64 offset2,
                                                int formats) {
    const int block = blockIdx.x;
    const int part = block >= first2 ? 2 : (block >= first1 ? 1 : 0);
    const int first = part == 2 ? first2 : (part == 1 ? first1 : 0);
    const uint4* tiles = w + (part == 2 ? offset2 : (part == 1 ? offset1 : 0));
    switch ((formats >> (2 * part)) & 3) {
        case 1:
            gemv_mma_tile<Q4kWeights, NT, DEPTH>(tiles, xs, y, n, k, chunks, m, accumulate, splits, scratch,
                                                 silu_pairs, first);
            break;
        case 2:
            gemv_mma_tile<ScaledI8Weights, NT, DEPTH>(tiles, xs, y, n, k, chunks, m, accumulate, splits, scratch,
                                                      silu_pairs, first);
            break;
        default:
            gemv_mma_tile<Bf16Weights, NT, DEPTH>(tiles, xs, y, n, k, chunks, m, accumulate, splits, scratch,
                                                  silu_pairs, first);
    }
}

#define GEMV_MIXED_KERNEL(name, NT, DEPTH)                                                                        \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                                                 \
        name(const uint4* __restrict__ w, const uint4* __restrict__ xs, float* __restrict__ y, int n, int k,       \
             int chunks, int m, int accumulate, int splits, float* __restrict__ scratch, int silu_pairs,        \
             int first1, int first2, u64 offset1, u64 offset2, int formats) {                                  \
        gemv_mixed_tile<NT, DEPTH>(w, xs, y, n, k, chunks, m, accumulate, splits, scratch, silu_pairs, first1,      \
                                   first2, offset1, offset2, formats);                                         \
    }
GEMV_MIXED_KERNEL(gemv_mixed_8_d4, 1, 4)
GEMV_MIXED_KERNEL(gemv_mixed_8_d2, 1, 2)
GEMV_MIXED_KERNEL(gemv_mixed_16, 2, 2)
GEMV_MIXED_KERNEL(gemv_mixed_24, 3, 2)
GEMV_MIXED_KERNEL(gemv_mixed_32, 4, 2)

// The GEMV's sums for many tokens at once (prefill, wide verifies and trees, batched serving), bit for bit: a
// block of GEMM_ROW_BLOCKS x GEMM_TOKEN_GROUPS warps owns GEMM_ROW_BLOCKS row blocks and GEMM_TOKEN_GROUPS * NT
// token tiles, so a row block's weights are read by one block for all of them (the GEMV's blocks for other tokens
// re-read them), and the blocks sharing a row block run together (token groups vary fastest in the grid).
// Same arithmetic as gemv_mma_tile, which is what keeps a row's result independent of the number of tokens: in
// the GEMV, warp w of a row block sums chunks c_begin + w, c_begin + w + 4, ... in order and warp 0 adds the four
// warps' sums in warp order. Here one warp keeps those four sums itself (acc[j] takes the chunks with
// (c - c_begin) % 4 == j, in order, with the same four mma's a chunk) and adds them in the same order at the end;
// an mma's output element depends only on its own row's weights, its own token's inputs and its accumulator.
#define GEMM_ROW_BLOCKS 4
#define GEMM_TOKEN_GROUPS 2
#define GEMM_WARPS (GEMM_ROW_BLOCKS * GEMM_TOKEN_GROUPS)

template <int NT>
__device__ __forceinline__ void gemm_mma_tile(const uint4* __restrict__ w, const uint4* __restrict__ xs,
                                              float* __restrict__ y, int n, int k, int chunks, int m, int accumulate,
                                              int splits, float* __restrict__ scratch, int silu_pairs) {
    constexpr int TILES = GEMM_TOKEN_GROUPS * NT;  // 8-token tiles a block owns
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wr = warp % GEMM_ROW_BLOCKS, wt = warp / GEMM_ROW_BLOCKS;
    const int row_block = blockIdx.y * GEMM_ROW_BLOCKS + wr;
    const bool has_rows = row_block * 16 < n;
    const int per_split = (chunks + splits - 1) / splits;
    const int c_begin = blockIdx.z * per_split, c_end = min(chunks, c_begin + per_split);
    const uint4* tiles = w + (size_t)row_block * chunks * 64;
    // Weights never depend on an earlier kernel: pull this warp's first stage into L2 while the previous one drains.
    if (has_rows && blockIdx.x == 0) {
        const int c = c_begin + (lane >> 3);
        if (c < c_end) asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(tiles + (size_t)c * 64) + (lane & 7) * 128));
    }
    PDL_ENTER();
    if (!has_rows) return;
    const int g = lane >> 2, t = lane & 3;
    const int tile0 = blockIdx.x * TILES + wt * NT;  // this warp's first token tile
    bool has_token[NT];
#pragma unroll
    for (int u = 0; u < NT; u++) has_token[u] = (tile0 + u) * 8 + g < m;
    float acc[MMA_WARPS][NT][4];
#pragma unroll
    for (int j = 0; j < MMA_WARPS; j++)
#pragma unroll
        for (int u = 0; u < NT; u++) acc[j][u][0] = acc[j][u][1] = acc[j][u][2] = acc[j][u][3] = 0.f;
    for (int c0 = c_begin; c0 < c_end; c0 += MMA_WARPS) {
        uint4 a[MMA_WARPS][2];
#pragma unroll
        for (int j = 0; j < MMA_WARPS; j++) {
            if (c0 + j < c_end) {
                a[j][0] = __ldg(tiles + (size_t)(c0 + j) * 64 + lane);
                a[j][1] = __ldg(tiles + (size_t)(c0 + j) * 64 + 32 + lane);
            }
        }
#pragma unroll
        for (int j = 0; j < MMA_WARPS; j++) {
            if (c0 + j < c_end) {
                uint4 b[NT][2];
#pragma unroll
                for (int u = 0; u < NT; u++) load_split(xs, tile0 + u, chunks, c0 + j, lane, has_token[u], b[u][0], b[u][1]);
#pragma unroll
                for (int u = 0; u < NT; u++) mma_chunk(acc[j][u], a[j], b[u][0], b[u][1]);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < NT; u++) {
        float d[4];
#pragma unroll
        for (int e = 0; e < 4; e++) d[e] = ((acc[0][u][e] + acc[1][u][e]) + acc[2][u][e]) + acc[3][u][e];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int token = (tile0 + u) * 8 + 2 * t + e;
            store_outputs(y, scratch, n, m, token, row_block, g, d[e], d[2 + e], silu_pairs, splits, accumulate);
        }
    }
}

#define GEMM_MMA_KERNEL(name, NT)                                                                                \
    extern "C" __global__ void __launch_bounds__(GEMM_WARPS * 32, 2)                                             \
        name(const uint4* __restrict__ w, const uint4* __restrict__ xs, float* __restrict__ y, int n, int k,       \
             int chunks, int m, int accumulate, int splits, float* __restrict__ scratch, int silu_pairs) {       \
        gemm_mma_tile<NT>(w, xs, y, n, k, chunks, m, accumulate, splits, scratch, silu_pairs);                 \
    }
// 32 and 64 tokens a block.
GEMM_MMA_KERNEL(gemm_mma_32, 2)
GEMM_MMA_KERNEL(gemm_mma_64, 4)

// The same sums again, for many tokens, with each chunk's operands staged in shared memory ahead of use: a block
// of GEMM_ROW_BLOCKS row blocks x 4 or 8 8-token tiles copies every chunk's weight tiles (bf16 4 KiB, nibble
// 1.5, scaled int8 2.5) and split activations (1 KiB a token tile) into one of STAGED_DEPTH buffers with cp.async,
// STAGED_DEPTH - 1 chunks ahead of the one its warps multiply, so no warp waits on L2 for an operand
// (gemm_mma_tile loads them where they are used, and ran at about half the GEMV's speed once activations came
// split: docs/benchmarks.md). Warp (wr, wt) expands row block wr's tile from shared memory as the GEMV does from
// global memory, multiplies it by its half of the block's token tiles and keeps the GEMV's four per-warp sums
// itself (acc[j] takes the chunks with (c - c_begin) % 4 == j, in order), adding them in warp order at the end:
// every output is the GEMV's bits (`selftest --device cuda` checks it). sm_80 and later.
#define STAGED_DEPTH 4

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    // Invalid sources read nothing and fill zeros (a row block past n, a token tile past m).
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// A lane's part of a weight tile staged in shared memory: what W::load reads from global memory, by plain loads.
template <typename W>
struct StagedLoad;
template <>
struct StagedLoad<Bf16Weights> {
    __device__ static __forceinline__ Bf16Weights::Raw load(const uint4* tile, int lane) {
        return {tile[lane], tile[lane + 32]};
    }
};
template <>
struct StagedLoad<Q4kWeights> {
    __device__ static __forceinline__ Q4kWeights::Raw load(const uint4* tile, int lane) {
        const uint2* nibbles = reinterpret_cast<const uint2*>(tile);
        const float2* factors = reinterpret_cast<const float2*>(tile + 16);
        const int g = lane >> 2;
        return {nibbles[lane], factors[g], factors[g + 8]};
    }
};
template <>
struct StagedLoad<ScaledI8Weights> {
    __device__ static __forceinline__ ScaledI8Weights::Raw load(const uint4* tile, int lane) {
        const float2* factors = reinterpret_cast<const float2*>(tile + 32);
        const int g = lane >> 2;
        return {tile[lane], factors[g], factors[g + 8]};
    }
};

// TILES 8-token tiles a block (8: 64 tokens, 4: 32), TILES / 2 a warp.
template <typename W, int TILES>
__device__ __forceinline__ void gemm_staged_tile(const uint4* __restrict__ w, const uint4* __restrict__ xs,
                                                 float* __restrict__ y, int n, int chunks, int m, int accumulate,
                                                 int splits, float* __restrict__ scratch, int silu_pairs) {
    constexpr int UT = TILES / 2;                                       // token tiles a warp
    constexpr int BUFFER = GEMM_ROW_BLOCKS * 64 + TILES * 64;           // room for bf16 tiles, the largest
    constexpr int PIECES = GEMM_ROW_BLOCKS * W::TILE_U4 + TILES * 64;  // 16-byte pieces a chunk
    __shared__ uint4 stage[STAGED_DEPTH][BUFFER];                       // 48 KiB at 64 tokens: the static limit
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wr = warp % GEMM_ROW_BLOCKS, wt = warp / GEMM_ROW_BLOCKS;
    const int rb0 = blockIdx.y * GEMM_ROW_BLOCKS, tile0 = blockIdx.x * TILES;
    const int row_blocks = (n + 15) >> 4, tiles = (m + 7) >> 3;
    const int per_split = (chunks + splits - 1) / splits;
    const int c_begin = blockIdx.z * per_split, c_end = min(chunks, c_begin + per_split);
    const int count = max(c_end - c_begin, 0);
    PDL_ENTER();
    // Chunk c_begin + i into buffer b: the row blocks' tiles first, then the token tiles', 16 bytes a copy.
    auto issue = [&](int i, int b) {
        const int c = c_begin + i;
        for (int u = threadIdx.x; u < PIECES; u += GEMM_WARPS * 32) {
            bool valid;
            const uint4* src;
            if (u < GEMM_ROW_BLOCKS * W::TILE_U4) {
                const int part = u / W::TILE_U4, off = u % W::TILE_U4;
                valid = rb0 + part < row_blocks;
                src = w + ((size_t)(rb0 + part) * chunks + c) * W::TILE_U4 + off;
            } else {
                const int v = u - GEMM_ROW_BLOCKS * W::TILE_U4;
                const int tile = tile0 + (v >> 6);
                valid = tile < tiles;
                src = xs + ((size_t)tile * chunks + c) * 64 + (v & 63);
            }
            cp_async_16(&stage[b][u], valid ? src : w, valid);
        }
    };
#pragma unroll
    for (int i = 0; i < STAGED_DEPTH - 1; i++) {
        if (i < count) issue(i, i);
        cp_async_commit();  // empty groups too: the wait below counts groups
    }
    const bool has_rows = (rb0 + wr) * 16 < n;
    const int g = lane >> 2, t = lane & 3;
    bool has_token[UT];
#pragma unroll
    for (int u = 0; u < UT; u++) has_token[u] = (tile0 + UT * wt + u) * 8 + g < m;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float acc[MMA_WARPS][UT][4];
#pragma unroll
    for (int j = 0; j < MMA_WARPS; j++)
#pragma unroll
        for (int u = 0; u < UT; u++) acc[j][u][0] = acc[j][u][1] = acc[j][u][2] = acc[j][u][3] = 0.f;
    for (int i0 = 0; i0 < count; i0 += MMA_WARPS) {
#pragma unroll
        for (int j = 0; j < MMA_WARPS; j++) {
            const int i = i0 + j;  // (c - c_begin) % 4 == j: the GEMV's warp j sums this chunk
            if (i < count) {       // the same in every thread: the barrier below is reached by all
                cp_async_wait<STAGED_DEPTH - 2>();  // this thread's copies of chunk i have landed
                __syncthreads();                     // everyone's have, and buffer (i - 1) % DEPTH is read
                if (i + STAGED_DEPTH - 1 < count) issue(i + STAGED_DEPTH - 1, (i + STAGED_DEPTH - 1) % STAGED_DEPTH);
                cp_async_commit();
                if (has_rows) {
                    const uint4* buf = stage[i % STAGED_DEPTH];
                    uint4 a[2];
                    W::expand(StagedLoad<W>::load(buf + wr * W::TILE_U4, lane), a);
#pragma unroll
                    for (int u = 0; u < UT; u++) {
                        const uint4* at = buf + GEMM_ROW_BLOCKS * W::TILE_U4 + (UT * wt + u) * 64 + lane;
                        const uint4 b0 = has_token[u] ? at[0] : zero, b1 = has_token[u] ? at[32] : zero;
                        mma_chunk(acc[j][u], a, b0, b1);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    if (!has_rows) return;
#pragma unroll
    for (int u = 0; u < UT; u++) {
        float d[4];
#pragma unroll
        for (int e = 0; e < 4; e++) d[e] = ((acc[0][u][e] + acc[1][u][e]) + acc[2][u][e]) + acc[3][u][e];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int token = (tile0 + UT * wt + u) * 8 + 2 * t + e;
            store_outputs(y, scratch, n, m, token, rb0 + wr, g, d[e], d[2 + e], silu_pairs, splits, accumulate);
        }
    }
}

#define GEMM_STAGED_KERNEL(name, W, TILES)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMM_WARPS * 32, 2)                                             \
        name(const uint4* __restrict__ w, const uint4* __restrict__ xs, float* __restrict__ y, int n, int k,       \
             int chunks, int m, int accumulate, int splits, float* __restrict__ scratch, int silu_pairs) {       \
        gemm_staged_tile<W, TILES>(w, xs, y, n, chunks, m, accumulate, splits, scratch, silu_pairs);          \
    }
GEMM_STAGED_KERNEL(gemm_staged_32, Bf16Weights, 4)
GEMM_STAGED_KERNEL(gemm_staged, Bf16Weights, 8)
GEMM_STAGED_KERNEL(gemm_staged_q4k_32, Q4kWeights, 4)
GEMM_STAGED_KERNEL(gemm_staged_q4k, Q4kWeights, 8)
GEMM_STAGED_KERNEL(gemm_staged_i8_32, ScaledI8Weights, 4)
GEMM_STAGED_KERNEL(gemm_staged_i8, ScaledI8Weights, 8)

// y[r][c] (+)= sum over splits, in split order, of scratch[split][r][c]; grid-stride over m * n.
extern "C" __global__ void splitk_reduce(const float* __restrict__ scratch, float* __restrict__ y, int n, int m,
                                         int splits, int accumulate) {
    PDL_ENTER();
    const size_t total = (size_t)m * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const float s = ordered_split_sum(scratch + i, splits, total);
        y[i] = accumulate ? y[i] + s : s;
    }
}


// After the fused QKV GEMV: adds the biases, rotates queries and keys, writes the queries to q and the keys and
// values to the row's sequence cache. qkv[r] holds q (heads * hd), then k and v (kv_heads * hd each); with
// splits > 1 qkv holds the GEMV's split-K partial sums (split_stride apart), added up here in split order.
// grid (rows, heads + 2 * kv_heads), block QKV_POST_THREADS (hd <= 256: a thread takes at most 2 pairs or 4
// values). The tables, biases and angles (rope_angles runs at least two kernels earlier: complete once this
// kernel starts under PDL) are read before waiting on the GEMV.
#define QKV_POST_THREADS 64
extern "C" __global__ void __launch_bounds__(QKV_POST_THREADS)
    qkv_post(const float* __restrict__ qkv, int splits, u64 split_stride, const float* __restrict__ bias,
             int has_bias, const float2* __restrict__ angles, const RowInfo* __restrict__ rows,
             const SeqCache* __restrict__ caches, int layer, int heads, int kv_heads, int hd, int halves,
             float* __restrict__ q) {
    const int r = blockIdx.x, seg = blockIdx.y, half = hd / 2;
    const int width = (heads + 2 * kv_heads) * hd;
    const size_t src = (size_t)r * width + (size_t)seg * hd;
    const float* b = has_bias ? bias + (size_t)seg * hd : nullptr;
    const RowInfo ri = rows[r];
    const SeqCache sc = caches[ri.seq];
    if (seg < heads + kv_heads) {
        // A query or key head: rotate pairs.
        float* dst;
        if (seg < heads) {
            dst = q + ((size_t)r * heads + seg) * hd;
        } else {
            const int h = seg - heads;
            dst = sc.base + ((((size_t)layer * 2 + 0) * kv_heads + h) * sc.capacity + ri.slot) * hd;
        }
        float2 a[2];
        float ba[2], bb[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = threadIdx.x + u * QKV_POST_THREADS;
            const int ia = halves ? i : 2 * i, ib = halves ? i + half : 2 * i + 1;
            const bool in = i < half;
            a[u] = in ? angles[(size_t)r * half + i] : make_float2(0.f, 0.f);
            ba[u] = in && b ? b[ia] : 0.f;
            bb[u] = in && b ? b[ib] : 0.f;
        }
        PDL_ENTER();
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = threadIdx.x + u * QKV_POST_THREADS;
            if (i < half) {
                const int ia = halves ? i : 2 * i, ib = halves ? i + half : 2 * i + 1;
                const float x0 = split_sum(qkv, splits, split_stride, src + ia) + ba[u];
                const float x1 = split_sum(qkv, splits, split_stride, src + ib) + bb[u];
                dst[ia] = x0 * a[u].y - x1 * a[u].x;
                dst[ib] = x0 * a[u].x + x1 * a[u].y;
            }
        }
    } else {
        const int h = seg - heads - kv_heads;
        float* dst = sc.base + ((((size_t)layer * 2 + 1) * kv_heads + h) * sc.capacity + ri.slot) * hd;
        float bv[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int d = threadIdx.x + u * QKV_POST_THREADS;
            bv[u] = d < hd && b ? b[d] : 0.f;
        }
        PDL_ENTER();
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int d = threadIdx.x + u * QKV_POST_THREADS;
            if (d < hd) dst[d] = split_sum(qkv, splits, split_stride, src + d) + bv[u];
        }
    }
}

// angles[r][i] = (sin, cos)(positions[r] * inv_freq[i]), the angle in double precision (large positions times
// small frequencies lose precision in float). grid (rows), block 64.
extern "C" __global__ void rope_angles(const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                                       float2* __restrict__ angles, int half) {
    PDL_ENTER();
    const int r = blockIdx.x;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double s, c;
        sincos((double)positions[r] * (double)inv_freq[i], &s, &c);
        angles[(size_t)r * half + i] = make_float2((float)s, (float)c);
    }
}

// Attention of row r, head h over its sequence's cache: slots 0..=slot, skipping new rows its tree mask hides.
// grid (rows, heads, max_splits), block ATT_WARPS * 32. Keys are taken in "visible order" (the cached context,
// then the row's ancestors among the new rows and itself; for a chain that is slot order). A row's V visible keys
// are cut into n = ceil(V / per) splits of `per` keys, per = CH * ceil(ceil(V / min(max_splits,
// ceil(V / (ATT_WARPS * CH * ATT_SPLIT_PASSES)))) / CH): block z takes split z (blocks past n have nothing to do), so a long
// context is spread over many multiprocessors instead of one block's warps taking chunk after chunk. In a split,
// keys go in chunks of CH; warp w takes chunks w, w + ATT_WARPS, ... in order. For a chunk a warp issues
// every key and value load at once (lanes split the head dimension in 16-byte pieces, so each key is one
// coalesced read), reduces the scores by butterfly, updates an online softmax and adds the chunk's values in slot
// order; then the warps are merged in warp order. With one split that is the output; with several, each block
// writes its split's (max, sum, values) to partials, and the block that finishes last (a counter per row and
// head, which that block puts back to zero) merges the splits in split order. The cut and every order are fixed
// by V and max_splits alone, so a row's result does not depend on the other rows of the launch, and a tree row's
// visible keys land in the same chunks and splits as the same keys of its branch run as a chain (bitwise the same
// result). P is the number of 16-byte pieces a lane holds (head dimension <= 128 * P).
//
// Before waiting on the previous kernel (qkv_post, which writes the queries and this step's keys and values),
// each warp loads its first chunk's cached keys and values (slots before the row's new ones, written by earlier
// steps): under PDL a kernel starts once the previous one has passed its own wait, so everything written two
// kernels back or earlier is complete, and the cache's memory latency overlaps qkv_post.
// Warps and keys a chunk measured on the H200 (docs/benchmarks.md, session 23; decode tok/s at 1024 tokens,
// qwen2.5-1.5b / llama-3.1-8b shapes): 16 warps x 2 keys 703 / 226, 16 x 4 685 / 221, 32 x 2 676 / 220 (spills),
// 8 x 4 671 / 217, 8 x 8 631 / 211. Short chunks keep more loads in flight over more warps at fewer registers.
#define ATT_WARPS 16
// Keys a chunk: CH = ATT_CHUNK / P (at least 1: ATT_CHUNK >= 2), so a lane holds the same number of 16-byte
// pieces at any P (8 keys at P = 2 needed 255 registers and spilled).
#define ATT_CHUNK 2
// Passes (chunks a warp) a split holds at least before the keys spread over another block.
#define ATT_SPLIT_PASSES 1
// A split's partial: max, sum, two floats of padding, then the head dimension's unnormalized values.
#define ATT_PARTIAL_HEADER 4
// The most splits a row and head may take (a lane each when they are merged; ops.rs MAX_ATTENTION_SPLITS).
#define ATT_MAX_SPLITS 32
// Splits whose values the merging warp loads at once.
#define ATT_MERGE_BATCH 4

// The position of the n-th (0-based) set bit of m.
__device__ __forceinline__ int nth_set_bit(u64 m, int n) {
    for (int b = 0; b < 64; b++) {
        if ((m >> b) & 1ull) {
            if (n == 0) return b;
            n--;
        }
    }
    return 63;
}

// Loads the keys and values of the chunk starting at visible index `first` whose indices fall in [lo, hi);
// leaves the chunk's other entries as they were.
template <int P, int CH>
__device__ __forceinline__ void attention_fetch(const float4* __restrict__ keys, const float4* __restrict__ values,
                                                const RowInfo& ri, int first, int lo, int hi, int lane, int pieces,
                                                float4 (&kv)[CH][P], float4 (&vv)[CH][P]) {
#pragma unroll
    for (int t = 0; t < CH; t++) {
        const int li = first + t;
        if (li >= lo && li < hi) {
            const int s =
                (!ri.is_tree || li < (int)ri.base) ? li : (int)ri.base + nth_set_bit(ri.tree_mask, li - (int)ri.base);
#pragma unroll
            for (int j = 0; j < P; j++) {
                const int i = lane + 32 * j;
                if (i < pieces) {
                    kv[t][j] = keys[(size_t)s * pieces + i];
                    vv[t][j] = values[(size_t)s * pieces + i];
                }
            }
        }
    }
}

// A row's visible keys and their cut into splits (see above): a function of the row and max_splits alone.
struct AttentionCut {
    int visible;
    int per;
    int splits;
};

template <int P>
__device__ __forceinline__ AttentionCut attention_cut(const RowInfo& ri, int max_splits) {
    constexpr int CH = ATT_CHUNK / P, SPLIT_KEYS = ATT_WARPS * CH * ATT_SPLIT_PASSES;
    const int visible = ri.is_tree ? (int)ri.base + __popcll(ri.tree_mask) : (int)ri.slot + 1;
    const int wanted_splits = min(max_splits, (visible + SPLIT_KEYS - 1) / SPLIT_KEYS);
    const int per = ((visible + wanted_splits - 1) / wanted_splits + CH - 1) / CH * CH;
    return AttentionCut{visible, per, (visible + per - 1) / per};
}

// Split `split` of row r and heads head0 .. head0 + G - 1 (its keys non-empty; the G heads share a KV head): the
// block's share of the row's attention for each head, merged by the block that finishes the row and head's last
// split. The G heads read the same keys and values, loaded once a chunk (grouped query attention: a multi-row
// pass of the qwen2.5-1.5b shape launched 12 blocks a row where 4 of 3 heads read the same cache); each head's
// arithmetic is the G = 1 item's, in the same order, so grouping changes no bit. With `enter`, the block's first
// item: its first chunk of cached keys is loaded before the PDL wait. Warps G and up return after writing their
// share; warp g merges head head0 + g and returns once it has written a partial or the output.
template <int P, int G>
__device__ __forceinline__ void attention_item(const float* __restrict__ q, u32* __restrict__ out, int out_chunks,
                                               const RowInfo& ri, int r, int head0, int split, int max_splits,
                                               const SeqCache* __restrict__ caches, int layer, int heads,
                                               int kv_heads, int hd, float scale, float* __restrict__ partials,
                                               u32* __restrict__ counters, bool enter) {
    constexpr int CH = ATT_CHUNK / P;
    static_assert(CH >= 1, "ATT_CHUNK must be at least the pieces a lane holds");
    static_assert(G >= 1 && G <= ATT_WARPS, "a merging warp a head");
    __shared__ float s_max[G][ATT_WARPS], s_sum[G][ATT_WARPS];
    __shared__ float4 s_acc[G][ATT_WARPS][32 * P];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pieces = hd >> 2;
    const AttentionCut cut = attention_cut<P>(ri, max_splits);
    const int visible_count = cut.visible, per = cut.per, splits = cut.splits;
    const int begin = split * per, end = min(visible_count, begin + per);
    const SeqCache sc = caches[ri.seq];
    const int kvh = head0 / (heads / kv_heads);
    const float4* keys =
        reinterpret_cast<const float4*>(sc.base + (((size_t)layer * 2 + 0) * kv_heads + kvh) * sc.capacity * hd);
    const float4* values =
        reinterpret_cast<const float4*>(sc.base + (((size_t)layer * 2 + 1) * kv_heads + kvh) * sc.capacity * hd);
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    // Keys before the row's first new slot were written by earlier steps.
    const int cached = min((int)ri.base, end);
    float4 kv[CH][P], vv[CH][P];
#pragma unroll
    for (int t = 0; t < CH; t++)
#pragma unroll
        for (int j = 0; j < P; j++) kv[t][j] = vv[t][j] = zero;
    const int first_chunk = begin + warp * CH;
    if (first_chunk < end) attention_fetch<P, CH>(keys, values, ri, first_chunk, begin, cached, lane, pieces, kv, vv);
    if (enter) {
        PDL_ENTER();
    }
    float4 qv[G][P], acc[G][P];
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float4* qh = reinterpret_cast<const float4*>(q + ((size_t)r * heads + head0 + g) * hd);
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int i = lane + 32 * j;
            qv[g][j] = i < pieces ? qh[i] : zero;
            acc[g][j] = zero;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }
    for (int first = first_chunk; first < end; first += ATT_WARPS * CH) {
        if (first == first_chunk) {
            // The chunk's new keys (this step's, written by qkv_post).
            attention_fetch<P, CH>(keys, values, ri, first, max(begin, cached), end, lane, pieces, kv, vv);
        } else {
#pragma unroll
            for (int t = 0; t < CH; t++)
#pragma unroll
                for (int j = 0; j < P; j++) kv[t][j] = vv[t][j] = zero;
            attention_fetch<P, CH>(keys, values, ri, first, begin, end, lane, pieces, kv, vv);
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            float score[CH];
            float chunk_max = NEG_INF;
#pragma unroll
            for (int t = 0; t < CH; t++) {
                float d = 0.f;
#pragma unroll
                for (int j = 0; j < P; j++) {
                    d = fmaf(qv[g][j].x, kv[t][j].x, d);
                    d = fmaf(qv[g][j].y, kv[t][j].y, d);
                    d = fmaf(qv[g][j].z, kv[t][j].z, d);
                    d = fmaf(qv[g][j].w, kv[t][j].w, d);
                }
                score[t] = first + t < end ? warp_sum(d) * scale : NEG_INF;
                chunk_max = fmaxf(chunk_max, score[t]);
            }
            // Every chunk holds at least one visible key, so chunk_max is finite.
            const float m_new = fmaxf(m[g], chunk_max);
            const float correction = expf(m[g] - m_new);
            float psum = 0.f;
#pragma unroll
            for (int j = 0; j < P; j++) {
                acc[g][j].x *= correction; acc[g][j].y *= correction;
                acc[g][j].z *= correction; acc[g][j].w *= correction;
            }
#pragma unroll
            for (int t = 0; t < CH; t++) {
                const float pt = first + t < end ? expf(score[t] - m_new) : 0.f;
                psum += pt;
#pragma unroll
                for (int j = 0; j < P; j++) {
                    acc[g][j].x = fmaf(pt, vv[t][j].x, acc[g][j].x);
                    acc[g][j].y = fmaf(pt, vv[t][j].y, acc[g][j].y);
                    acc[g][j].z = fmaf(pt, vv[t][j].z, acc[g][j].z);
                    acc[g][j].w = fmaf(pt, vv[t][j].w, acc[g][j].w);
                }
            }
            l[g] = l[g] * correction + psum;
            m[g] = m_new;
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) {
            s_max[g][warp] = m[g];
            s_sum[g][warp] = l[g];
        }
#pragma unroll
        for (int j = 0; j < P; j++) s_acc[g][warp][lane + 32 * j] = acc[g][j];
    }
    __syncthreads();
    if (warp >= G) return;
    const int g = warp, head = head0 + g;
    // Unrolled (ATT_WARPS is fixed), so the shared-memory loads and exponentials of all warps overlap; the adds
    // stay in warp order.
    float gm = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) gm = fmaxf(gm, s_max[g][w]);
    float gl = 0.f;
    float4 total[P];
#pragma unroll
    for (int j = 0; j < P; j++) total[j] = zero;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        if (s_max[g][w] == NEG_INF) continue;
        const float f = expf(s_max[g][w] - gm);
        gl += s_sum[g][w] * f;
#pragma unroll
        for (int j = 0; j < P; j++) {
            const float4 a = s_acc[g][w][lane + 32 * j];
            total[j].x += a.x * f; total[j].y += a.y * f; total[j].z += a.z * f; total[j].w += a.w * f;
        }
    }
    if (splits > 1) {
        const size_t stride = (size_t)hd + ATT_PARTIAL_HEADER;
        float* mine = partials + ((size_t)(r * heads + head) * max_splits + split) * stride;
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int i = lane + 32 * j;
            if (i < pieces) reinterpret_cast<float4*>(mine + ATT_PARTIAL_HEADER)[i] = total[j];
        }
        if (lane == 0) {
            mine[0] = gm;
            mine[1] = gl;
        }
        // Publish the partial before counting it; the last block to count sees every split's.
        __threadfence();
        __syncwarp();
        u32* counter = counters + (size_t)r * heads + head;
        u32 done = 0;
        if (lane == 0) done = atomicAdd(counter, 1u);
        done = __shfl_sync(0xffffffffu, done, 0);
        if ((int)done != splits - 1) return;
        __threadfence();
        if (lane == 0) *counter = 0u;  // ready for the next launch
        const float* all = partials + (size_t)(r * heads + head) * max_splits * stride;
        // Lane z reads split z's max and sum (splits <= 32), so all of them arrive in one round trip; the values
        // come ATT_MERGE_BATCH splits a round trip. The merge itself runs in split order.
        const float mz = lane < splits ? __ldcg(all + lane * stride) : NEG_INF;
        const float sz = lane < splits ? __ldcg(all + lane * stride + 1) : 0.f;
        gm = mz;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, o));
        const float fz = lane < splits ? expf(mz - gm) : 0.f;
        gl = 0.f;
#pragma unroll
        for (int j = 0; j < P; j++) total[j] = zero;
        for (int z0 = 0; z0 < splits; z0 += ATT_MERGE_BATCH) {
            float4 a[ATT_MERGE_BATCH][P];
#pragma unroll
            for (int u = 0; u < ATT_MERGE_BATCH; u++) {
#pragma unroll
                for (int j = 0; j < P; j++) {
                    const int i = lane + 32 * j;
                    a[u][j] = z0 + u < splits && i < pieces
                                  ? __ldcg(reinterpret_cast<const float4*>(all + (z0 + u) * stride + ATT_PARTIAL_HEADER) + i)
                                  : zero;
                }
            }
#pragma unroll
            for (int u = 0; u < ATT_MERGE_BATCH; u++) {
                const int z = z0 + u;
                const float f = __shfl_sync(0xffffffffu, fz, z & 31);
                const float sum = __shfl_sync(0xffffffffu, sz, z & 31);
                if (z < splits) {
                    gl += sum * f;
#pragma unroll
                    for (int j = 0; j < P; j++) {
                        const int i = lane + 32 * j;
                        if (i < pieces) {
                            total[j].x += a[u][j].x * f; total[j].y += a[u][j].y * f;
                            total[j].z += a[u][j].z * f; total[j].w += a[u][j].w * f;
                        }
                    }
                }
            }
        }
    }
    // Written split for the output projection's GEMV (row r's inputs head * hd ...).
#pragma unroll
    for (int j = 0; j < P; j++) {
        const int i = lane + 32 * j;
        if (i < pieces) {
            const int col = head * hd + 4 * i;
            store_split_pair(out, out_chunks, r, col, total[j].x / gl, total[j].y / gl);
            store_split_pair(out, out_chunks, r, col + 2, total[j].z / gl, total[j].w / gl);
        }
    }
}

// Grid (rows, heads / G, max_splits): block (r, y, z) takes split z of row r and heads G y .. G y + G - 1 (blocks
// past the row's splits have nothing to do; block z = 0 always has keys: it waits and triggers for the launch).
template <int P, int G>
__device__ __forceinline__ void attention_rows(const float* __restrict__ q, u32* __restrict__ out, int out_chunks,
                                               const RowInfo* __restrict__ rows, const SeqCache* __restrict__ caches,
                                               int layer, int heads, int kv_heads, int hd, float scale,
                                               float* __restrict__ partials, u32* __restrict__ counters) {
    const int r = blockIdx.x, head0 = blockIdx.y * G, split = blockIdx.z, max_splits = gridDim.z;
    // The step's tables come from the host before the step: readable before the wait.
    const RowInfo ri = rows[r];
    if (split >= attention_cut<P>(ri, max_splits).splits) return;
    attention_item<P, G>(q, out, out_chunks, ri, r, head0, split, max_splits, caches, layer, heads, kv_heads, hd,
                         scale, partials, counters, true);
}

// The most rows attention_list takes (ops.rs ATTENTION_LIST_MAX_ROWS): a table of each row's first item.
#define ATT_LIST_MAX_ROWS 64

// The same items as attention_rows (row r, head, split z < the row's splits; the same arithmetic in each, so the
// same bits), listed (rows in order, then heads, then splits) and taken by a grid of `gridDim.x` blocks, block b
// items b, b + gridDim.x, ...: attention_rows' grid of rows x heads x max_splits blocks is mostly empty at short
// contexts (64 keys: 2 of 11 splits), and its blocks (one a multiprocessor at 512 threads) came in waves, ~1.3
// us a row and layer on the H200. An item runs slower than the grid's block, though (1 row: 1.35 against 1.26 ms
// a qwen2.5-1.5b pass), so ops.rs takes the list from 12 rows (16 rows: 1.92 against 1.97 ms, 32: 2.69 against
// 3.04). Block 0 always has item 0: it waits and triggers for the launch.
template <int P, int G>
__device__ __forceinline__ void attention_list(const float* __restrict__ q, u32* __restrict__ out, int out_chunks,
                                               const RowInfo* __restrict__ rows, int n_rows,
                                               const SeqCache* __restrict__ caches, int layer, int heads,
                                               int kv_heads, int hd, float scale, int max_splits,
                                               float* __restrict__ partials, u32* __restrict__ counters) {
    __shared__ int s_first[ATT_LIST_MAX_ROWS + 1];
    const int groups = heads / G;
    // Each row's items (a thread a row, two a lane of warp 0), summed by a scan in warp 0.
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int r0 = 2 * lane, r1 = 2 * lane + 1;
        const int c0 = r0 < n_rows ? groups * attention_cut<P>(rows[r0], max_splits).splits : 0;
        const int c1 = r1 < n_rows ? groups * attention_cut<P>(rows[r1], max_splits).splits : 0;
        int incl = c0 + c1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int excl = incl - c0 - c1;
        if (r0 <= n_rows) s_first[r0] = excl;
        if (r1 <= n_rows) s_first[r1] = excl + c0;
        if (lane == 31 && n_rows == ATT_LIST_MAX_ROWS) s_first[ATT_LIST_MAX_ROWS] = incl;
    }
    __syncthreads();
    const int total = s_first[n_rows];
    int r = 0;
    // The first item loads its first chunk of cached keys before the PDL wait (peeled: as a constant `enter`
    // the item compiles as attention_rows' does).
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        while (s_first[r + 1] <= t) r++;
        const int splits = (s_first[r + 1] - s_first[r]) / groups;
        const int i = t - s_first[r];
        if (t == (int)blockIdx.x) {
            attention_item<P, G>(q, out, out_chunks, rows[r], r, i / splits * G, i % splits, max_splits, caches,
                                 layer, heads, kv_heads, hd, scale, partials, counters, true);
        } else {
            // The last item's shared memory is read (the merging warps') before this one's is written.
            __syncthreads();
            attention_item<P, G>(q, out, out_chunks, rows[r], r, i / splits * G, i % splits, max_splits, caches,
                                 layer, heads, kv_heads, hd, scale, partials, counters, false);
        }
    }
}

#define ATTENTION_KERNEL(name, list_name, P, G)                                                                    \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)                                                  \
        name(const float* __restrict__ q, u32* __restrict__ out, int out_chunks, const RowInfo* __restrict__ rows, \
             const SeqCache* __restrict__ caches, int layer, int heads, int kv_heads, int hd, float scale,         \
             float* __restrict__ partials, u32* __restrict__ counters) {                                           \
        attention_rows<P, G>(q, out, out_chunks, rows, caches, layer, heads, kv_heads, hd, scale, partials,       \
                             counters);                                                                            \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, 1)                                               \
        list_name(const float* __restrict__ q, u32* __restrict__ out, int out_chunks,                              \
                  const RowInfo* __restrict__ rows, int n_rows, const SeqCache* __restrict__ caches, int layer,    \
                  int heads, int kv_heads, int hd, float scale, int max_splits, float* __restrict__ partials,      \
                  u32* __restrict__ counters) {                                                                    \
        attention_list<P, G>(q, out, out_chunks, rows, n_rows, caches, layer, heads, kv_heads, hd, scale,         \
                             max_splits, partials, counters);                                                      \
    }
ATTENTION_KERNEL(attention_128, attention_list_128, 1, 1)
ATTENTION_KERNEL(attention_256, attention_list_256, 2, 1)
// Heads sharing a KV head taken G a block (ops.rs attention_group): head dimension <= 128 only (at 256 the shared
// memory of G > 1 heads' warp merge does not fit).
ATTENTION_KERNEL(attention_128_g2, attention_list_128_g2, 1, 2)
ATTENTION_KERNEL(attention_128_g3, attention_list_128_g3, 1, 3)
ATTENTION_KERNEL(attention_128_g4, attention_list_128_g4, 1, 4)

// An EAGLE-3 head's feature rows gathered from the target's step outputs where they lie: row r, layer l comes from
// the address in table[2 * (r * max_layers + l)] (two words, low first), `cols` floats, to out[r * width + l *
// cols ...]; address 0 (a row uploaded from the host, or no such layer) is left alone. grid (rows, max_layers),
// block 256. A plain copy: the same bits as the host's readback and upload.
extern "C" __global__ void gather_feature_rows(const u32* __restrict__ table, float* __restrict__ out, int max_layers,
                                               int cols, int width) {
    const int r = blockIdx.x, l = blockIdx.y;
    const u32* e = table + 2 * ((size_t)r * max_layers + l);
    const u64 address = (u64)e[0] | ((u64)e[1] << 32);
    PDL_ENTER();
    if (address == 0) return;
    const float* src = reinterpret_cast<const float*>(address);
    float* dst = out + (size_t)r * width + (size_t)l * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

// Row r of `width` floats copied from the address at table[4r..4r+2] to the one at table[4r+2..4r+4] (u64s as two
// words, low first): a batched head pass's per-sequence rows (each sequence's last output fed in, or kept) in one
// launch instead of a copy each. grid (rows), block 256.
extern "C" __global__ void copy_rows_by_address(const u32* __restrict__ table, int width) {
    const u32* e = table + 4 * (size_t)blockIdx.x;
    const u64 from = (u64)e[0] | ((u64)e[1] << 32), to = (u64)e[2] | ((u64)e[3] << 32);
    PDL_ENTER();
    const float* src = reinterpret_cast<const float*>(from);
    float* dst = reinterpret_cast<float*>(to);
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// A greedy chain on the device (backend/cuda/head.rs run_greedy_chain), between two one-row head passes: keeps
// the last pass's top token and probability (top_token's output) as the chain's step `step`, feeds that token
// (as a target id, through d2t) to the next row and moves the one-row tables (positions, RowInfo) one slot on.
// A top that is not a draft id (non-finite logits) feeds token 0; the host refuses it when it reads the chain.
// grid 1, block 32.
__device__ __forceinline__ void chain_step(float id_bits, float p, const u32* __restrict__ draft_to_target,
                                           u32 draft_vocab, u32* __restrict__ ints, float* __restrict__ chain,
                                           int step, int positions_at, int rows_at) {
    const u32 id = __float_as_uint(id_bits);
    chain[2 * step] = id_bits;
    chain[2 * step + 1] = p;
    ints[0] = id < draft_vocab ? draft_to_target[id] : 0u;
    ints[positions_at] += 1;
    RowInfo* row = reinterpret_cast<RowInfo*>(ints + rows_at);
    row->slot += 1;
    row->base += 1;
}

extern "C" __global__ void chain_next(const float* __restrict__ top, const u32* __restrict__ draft_to_target,
                                      u32 draft_vocab, u32* __restrict__ ints, float* __restrict__ chain, int step,
                                      int positions_at, int rows_at) {
    PDL_ENTER();
    if (threadIdx.x != 0) return;
    chain_step(top[0], top[1], draft_to_target, draft_vocab, ints, chain, step, positions_at, rows_at);
}

// chain_next over the n sequences of a batched device chain (backend/cuda/head.rs chain_rounds): row s keeps
// sequence s's last top (top[2s], top[2s + 1]: top_token's output for wanted row s) as step `step` of its chain
// (chain[2 (step n + s)]), feeds it (as a target id, through d2t) and moves its position and slot one on.
// grid 1, block >= n.
extern "C" __global__ void chain_next_rows(const float* __restrict__ top, const u32* __restrict__ draft_to_target,
                                           u32 draft_vocab, u32* __restrict__ ints, float* __restrict__ chain,
                                           int step, int n, int positions_at, int rows_at) {
    PDL_ENTER();
    const int s = threadIdx.x;
    if (s >= n) return;
    const u32 id = __float_as_uint(top[2 * s]);
    const size_t at = 2 * ((size_t)step * n + s);
    chain[at] = top[2 * s];
    chain[at + 1] = top[2 * s + 1];
    ints[s] = id < draft_vocab ? draft_to_target[id] : 0u;
    ints[positions_at + s] += 1;
    RowInfo* row = reinterpret_cast<RowInfo*>(ints + rows_at) + s;
    row->slot += 1;
    row->base += 1;
}

// out[j] = x[src[j]] for the rows that need logits; grid (rows), block 256.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ src,
                                       float* __restrict__ out, int h) {
    PDL_ENTER();
    const int j = blockIdx.x;
    const float* from = x + (size_t)src[j] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[(size_t)j * h + i] = from[i];
}

// The tail of an RMS norm over a row whose pieces this thread holds (rms_norm's steps and order, for a block of
// norm_threads(h)): the sum of squares in piece order, butterfly within warps, warp totals in order by warp 0;
// then out = v * scale * g, written split for the GEMV that reads it. `partial` is the block's 32 shared floats.
// (rms_norm has the same steps inline; it moves onto this once a device run shows the two bitwise equal.)
__device__ __forceinline__ void rms_scale_store(const float4 (&v)[NORM_PIECES], const float4 (&g)[NORM_PIECES], int h,
                                                float eps, u32* __restrict__ out, int out_chunks, int r,
                                                float* partial, int col0 = 0) {
    const int pieces = h >> 2;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) s += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    s = warp_sum(s);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) partial[0] = rsqrtf(t / (float)h + eps);
    }
    __syncthreads();
    const float scale = partial[0];
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < pieces) {
            store_split_pair(out, out_chunks, r, col0 + 4 * i, v[j].x * scale * g[j].x, v[j].y * scale * g[j].y);
            store_split_pair(out, out_chunks, r, col0 + 4 * i + 2, v[j].z * scale * g[j].z,
                             v[j].w * scale * g[j].w);
        }
    }
}

// A norm's weights, loaded before the kernel waits on the one before it (weights never come from a kernel).
__device__ __forceinline__ void load_norm_weights(const float* __restrict__ w, int h, float4 (&g)[NORM_PIECES]) {
    const float4* wr = reinterpret_cast<const float4*>(w);
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        g[j] = i < (h >> 2) ? wr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// An EAGLE-3 head pass's inputs in one launch instead of four (embed_rows, rope_angles and two rms_norm; head.rs,
// SPECULA_CUDA_HEAD_FUSED=1): grid (rows, 3), block ops.rs norm_threads(h). Part 0: row r's token from the tiled
// embedding table, normalized by w_embed into out_embed; part 1: row r of x normalized by w_x into out_x; part
// 2: row r's rotary angles (rope_angles' arithmetic; qkv_post, three kernels later, reads them before it waits).
// Part 1 writes from column x_col of out_x's rows (out_chunks chunks a row): with out_x = out_embed, x_col = h and
// out_chunks = 2h / 32, the two normed inputs are one row of 2h for a single QKV GEMV over both halves. With
// x_splits > 0, x is not written yet: part 1 takes row r as the sum of fc's split-K partial sums (x_partials,
// x_stride apart, in split order as splitk_reduce would) and writes it to x first.
extern "C" __global__ void __launch_bounds__(1024)
    head_inputs(const bf16_t* __restrict__ table, int table_chunks, const u32* __restrict__ tokens,
                float* __restrict__ x, const float* __restrict__ w_embed, const float* __restrict__ w_x,
                u32* __restrict__ out_embed, u32* __restrict__ out_x, int h, float eps, int out_chunks,
                const u32* __restrict__ positions, const float* __restrict__ inv_freq, float2* __restrict__ angles,
                int half, int x_col, const float* __restrict__ x_partials, int x_splits, u64 x_stride) {
    __shared__ float partial[32];
    const int r = blockIdx.x, part = blockIdx.y;
    if (part == 2) {
        PDL_ENTER();
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            double s, c;
            sincos((double)positions[r] * (double)inv_freq[i], &s, &c);
            angles[(size_t)r * half + i] = make_float2((float)s, (float)c);
        }
        return;
    }
    float4 g[NORM_PIECES];
    load_norm_weights(part == 0 ? w_embed : w_x, h, g);
    PDL_ENTER();
    const int pieces = h >> 2;
    float4 v[NORM_PIECES];
    if (part == 0) {
        const u32 token = tokens[r];
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            v[j] = i < pieces ? make_float4(bf16_to_f32(table[tiled_index(token, 4 * i, table_chunks)]),
                                            bf16_to_f32(table[tiled_index(token, 4 * i + 1, table_chunks)]),
                                            bf16_to_f32(table[tiled_index(token, 4 * i + 2, table_chunks)]),
                                            bf16_to_f32(table[tiled_index(token, 4 * i + 3, table_chunks)]))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    } else if (x_splits > 0) {
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        add_split_residual(v, reinterpret_cast<float4*>(x + (size_t)r * h), x_partials, x_splits, x_stride, r, h);
    } else {
        const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * h);
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            v[j] = i < pieces ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    rms_scale_store(v, g, h, eps, part == 0 ? out_embed : out_x, out_chunks, r, partial, part == 0 ? 0 : x_col);
}

// out = rms_norm(x[src[j]]) for the rows that need logits, in one launch instead of gather_rows and rms_norm
// (head.rs, SPECULA_CUDA_HEAD_FUSED=1); grid (rows), block ops.rs norm_threads(h).
// With splits > 0 it first adds a deferred split-K residual update into row src[j] of x and writes that row back
// (rms_norm's arithmetic): the down projection's sums, for a pass whose every row is gathered (a chain step).
extern "C" __global__ void __launch_bounds__(1024)
    gather_rms_norm(float* __restrict__ x, const u32* __restrict__ src, const float* __restrict__ w,
                    u32* __restrict__ out, int h, float eps, int out_chunks, const float* __restrict__ partials,
                    int splits, u64 split_stride) {
    __shared__ float partial[32];
    const int j = blockIdx.x;
    float4 g[NORM_PIECES];
    load_norm_weights(w, h, g);
    PDL_ENTER();
    const size_t row = src[j];
    float4* xr = reinterpret_cast<float4*>(x + row * h);
    const int pieces = h >> 2;
    float4 v[NORM_PIECES];
#pragma unroll
    for (int k = 0; k < NORM_PIECES; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < pieces ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (splits > 0) add_split_residual(v, xr, partials, splits, split_stride, row, h);
    rms_scale_store(v, g, h, eps, out, out_chunks, j, partial);
}

// Row argmax in two launches, so a 152k-column row is read by many blocks at once (one block a row took 0.13 ms):
// argmax_partial: grid (rows, ARGMAX_PARTS), block 256; part b of row r takes columns [b * span, (b + 1) * span)
// and writes its largest value and that value's first column to part_val/part_idx[r * ARGMAX_PARTS + b];
// argmax_final: grid (rows), block ARGMAX_PARTS, picks the largest of the parts, the first column on ties (as the
// CPU's argmax). The largest value with the smallest column does not depend on the order of comparisons.
#define ARGMAX_PARTS 64

// Whether (v, i) beats (best_v, best_i): larger, or equal at an earlier column; an empty slot (index ~0) loses.
__device__ __forceinline__ bool argmax_beats(float v, u32 i, float best_v, u32 best_i) {
    return best_i == 0xffffffffu || (i != 0xffffffffu && (v > best_v || (v == best_v && i < best_i)));
}

__device__ __forceinline__ void argmax_block(float& v, u32& idx, float* s_val, u32* s_idx) {
    s_val[threadIdx.x] = v;
    s_idx[threadIdx.x] = idx;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float ov = s_val[threadIdx.x + stride];
            const u32 oi = s_idx[threadIdx.x + stride];
            if (argmax_beats(ov, oi, s_val[threadIdx.x], s_idx[threadIdx.x])) {
                s_val[threadIdx.x] = ov;
                s_idx[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    v = s_val[0];
    idx = s_idx[0];
}

extern "C" __global__ void argmax_partial(const float* __restrict__ x, float* __restrict__ part_val,
                                          u32* __restrict__ part_idx, int n) {
    PDL_ENTER();
    __shared__ float s_val[256];
    __shared__ u32 s_idx[256];
    const int r = blockIdx.x, b = blockIdx.y;
    const int span = (n + ARGMAX_PARTS - 1) / ARGMAX_PARTS;
    const int end = min(n, (b + 1) * span);
    const float* row = x + (size_t)r * n;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int c = b * span + threadIdx.x; c < end; c += blockDim.x) {
        const float e = row[c];
        if (idx == 0xffffffffu || e > v) { v = e; idx = c; }
    }
    argmax_block(v, idx, s_val, s_idx);
    if (threadIdx.x == 0) {
        part_val[r * ARGMAX_PARTS + b] = v;
        part_idx[r * ARGMAX_PARTS + b] = idx;
    }
}

extern "C" __global__ void argmax_final(const float* __restrict__ part_val, const u32* __restrict__ part_idx,
                                        u32* __restrict__ best) {
    PDL_ENTER();
    __shared__ float s_val[ARGMAX_PARTS];
    __shared__ u32 s_idx[ARGMAX_PARTS];
    const int r = blockIdx.x;
    float v = part_val[r * ARGMAX_PARTS + threadIdx.x];
    u32 idx = part_idx[r * ARGMAX_PARTS + threadIdx.x];
    argmax_block(v, idx, s_val, s_idx);
    if (threadIdx.x == 0) best[r] = idx;
}

// Each row's largest element (the first on ties) and its softmax probability, packed as out[2r] = index bits,
// out[2r + 1] = 1 / sum(exp(x - max)): what a greedy drafter needs of a row, 8 bytes instead of the whole row.
// grid (rows), block TOP_TOKEN_THREADS. One pass (an online softmax: each thread keeps its largest value and its
// sum of exp relative to it, rescaled when the largest grows) with four independent loads in flight a thread: a
// block of 256 threads taking a max pass and then a sum pass, one dependent load at a time, took ~0.1 ms over a
// 65536-column row, a seventh of a 0.5B draft model's step on an H200. Deterministic: each thread visits its
// columns in a fixed order and the block combines in a fixed tree, whatever the number of rows.
#define TOP_TOKEN_THREADS 1024
// With splits > 1, x holds a GEMV's split-K partial sums (split_stride apart), added up here in split order (as
// splitk_reduce would): the EAGLE-3 head's LM head without its reduction launch. With chain set (a one-row pass
// of a device chain, grid 1), thread 0 then does what chain_next would do next with this pass's top, as chain
// step `step` (one launch fewer a chain step); null elsewhere.
extern "C" __global__ void __launch_bounds__(TOP_TOKEN_THREADS)
    top_token(const float* __restrict__ x, float* __restrict__ out, int n, int splits, u64 split_stride,
              float* __restrict__ chain, const u32* __restrict__ draft_to_target, u32 draft_vocab,
              u32* __restrict__ ints, int step, int positions_at, int rows_at) {
    PDL_ENTER();
    __shared__ float s_max[TOP_TOKEN_THREADS];
    __shared__ u32 s_idx[TOP_TOKEN_THREADS];
    __shared__ float s_sum[TOP_TOKEN_THREADS];
    const float* row = x + (size_t)blockIdx.x * n;
    const int bd = blockDim.x;
    float m = NEG_INF, sum = 0.f;
    u32 idx = 0xffffffffu;
    // Takes column c's value e (columns come in increasing order within a thread: the first wins ties).
    auto take = [&](float e, int c) {
        if (idx == 0xffffffffu || e > m) {
            // exp(-inf - e) = 0: nothing to rescale before the first finite value.
            sum = (m == NEG_INF ? 0.f : sum * expf(m - e)) + 1.f;
            m = e;
            idx = c;
        } else if (e != NEG_INF) {
            sum += expf(e - m);
        }
    };
    int c = threadIdx.x;
    if (splits > 1) {
        for (; c < n; c += bd) take(ordered_split_sum(row + c, splits, split_stride), c);
    } else {
        for (; c + 3 * bd < n; c += 4 * bd) {
            const float e0 = row[c], e1 = row[c + bd], e2 = row[c + 2 * bd], e3 = row[c + 3 * bd];
            take(e0, c);
            take(e1, c + bd);
            take(e2, c + 2 * bd);
            take(e3, c + 3 * bd);
        }
        for (; c < n; c += bd) take(row[c], c);
    }
    s_max[threadIdx.x] = m;
    s_idx[threadIdx.x] = idx;
    s_sum[threadIdx.x] = sum;
    __syncthreads();
    for (int stride = bd / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float om = s_max[threadIdx.x + stride], mm = s_max[threadIdx.x];
            const u32 oi = s_idx[threadIdx.x + stride];
            const float hi = fmaxf(om, mm);
            // Both sums relative to the larger maximum (an empty side, -inf, adds nothing).
            const float scaled = (mm == NEG_INF ? 0.f : s_sum[threadIdx.x] * expf(mm - hi)) +
                                 (om == NEG_INF ? 0.f : s_sum[threadIdx.x + stride] * expf(om - hi));
            if (argmax_beats(om, oi, mm, s_idx[threadIdx.x])) {
                s_max[threadIdx.x] = om;
                s_idx[threadIdx.x] = oi;
            }
            s_sum[threadIdx.x] = scaled;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const float id_bits = __uint_as_float(s_idx[0]);
        // A row of -inf only: every column equally (un)likely.
        const float p = s_max[0] == NEG_INF ? 1.f / n : 1.f / s_sum[0];
        out[2 * blockIdx.x] = id_bits;
        out[2 * blockIdx.x + 1] = p;
        if (chain != nullptr) chain_step(id_bits, p, draft_to_target, draft_vocab, ints, chain, step, positions_at,
                                         rows_at);
    }
}

// Each row's k largest elements, best first (ties: the earlier column), with their log-softmax values, packed as
// out[2(rk + i)] = index bits, out[2(rk + i) + 1] = x - max - log(sum(exp(x - max))): what a tree drafter needs to
// expand a node (2k floats instead of the draft vocabulary's logits). k passes over the row, each taking the best
// element ranked below the previous pick, so the result does not depend on the order of comparisons.
// grid (rows), block 256. (A one-pass variant, each of 1024 threads keeping its own k best and k merge rounds, was
// no faster in tree drafting on the H200, and slower at k = 8 over a 32k draft vocabulary: docs/benchmarks.md,
// session 28.)
extern "C" __global__ void top_k_log_probs(const float* __restrict__ x, float* __restrict__ out, int n, int k) {
    PDL_ENTER();
    __shared__ float s_val[256];
    __shared__ u32 s_idx[256];
    __shared__ float s_max, s_log_z;
    const float* row = x + (size_t)blockIdx.x * n;
    float* dst = out + 2 * (size_t)blockIdx.x * k;
    float prev_v = __int_as_float(0x7f800000);
    u32 prev_i = 0xffffffffu;
    for (int pick = 0; pick < k; ++pick) {
        float v = NEG_INF;
        u32 idx = 0xffffffffu;
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            const float e = row[c];
            // Ranked below the previous pick: smaller, or equal at a later column.
            const bool below = pick == 0 || e < prev_v || (e == prev_v && (u32)c > prev_i);
            if (below && (idx == 0xffffffffu || e > v)) { v = e; idx = c; }
        }
        argmax_block(v, idx, s_val, s_idx);
        __syncthreads();
        if (pick == 0) {
            // The row's log-normalizer, from its largest element.
            float sum = 0.f;
            for (int c = threadIdx.x; c < n; c += blockDim.x) sum += expf(row[c] - v);
            s_val[threadIdx.x] = sum;
            __syncthreads();
            for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
                if (threadIdx.x < stride) s_val[threadIdx.x] += s_val[threadIdx.x + stride];
                __syncthreads();
            }
            if (threadIdx.x == 0) {
                s_max = v;
                s_log_z = logf(s_val[0]);
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            dst[2 * pick] = __uint_as_float(idx);
            dst[2 * pick + 1] = idx == 0xffffffffu ? NEG_INF : v - s_max - s_log_z;
        }
        prev_v = v;
        prev_i = idx;
        __syncthreads();
    }
}

// y[r][j] = x[r][cols[j]]: the columns a caller needs of a wide matrix (the draft vocabulary's logits).
extern "C" __global__ void gather_columns(const float* __restrict__ x, const u32* __restrict__ cols,
                                          float* __restrict__ y, int n_cols, int x_cols) {
    PDL_ENTER();
    const size_t r = blockIdx.y;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n_cols; j += gridDim.x * blockDim.x)
        y[r * n_cols + j] = x[r * x_cols + cols[j]];
}

// Fills a bf16 buffer with seeded uniform values in [-scale, scale) (random weights of real shapes for speed
// work, made on the device). A counter-based hash, so any element's value depends only on (seed, index).
extern "C" __global__ void fill_random_bf16(bf16_t* __restrict__ out, size_t n, u64 seed, float scale) {
    PDL_ENTER();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u64 z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f) * 2.f - 1.f;
        out[i] = (bf16_t)(__float_as_uint(u * scale) >> 16);
    }
}

// After a tree verify: moves new rows src[j] (relative to slot `base`, increasing) to base + j, for every layer,
// kind (keys, values) and KV head of one sequence's cache. grid (layers * 2 * kv_heads), block 128. Increasing
// sources are never below their destinations, so copying in order reads each source before it is overwritten.
extern "C" __global__ void kv_keep_rows(float* __restrict__ cache, u32 capacity, const u32* __restrict__ src,
                                        int count, u32 base, int hd) {
    PDL_ENTER();
    float* head = cache + (size_t)blockIdx.x * capacity * hd;
    for (int j = 0; j < count; j++) {
        const float* from = head + (size_t)(base + src[j]) * hd;
        float* to = head + (size_t)(base + j) * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) to[d] = from[d];
        __syncthreads();
    }
}
