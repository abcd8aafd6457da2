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

// out[r][i] = table[tokens[r]][i], bf16 -> f32. grid (rows), block 256.
extern "C" __global__ void embed_rows(const bf16_t* __restrict__ table, const u32* __restrict__ tokens,
                                      float* __restrict__ out, int h) {
    const int r = blockIdx.x;
    const bf16_t* src = table + (size_t)tokens[r] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[(size_t)r * h + i] = bf16_to_f32(src[i]);
}

// out[r] = x[r] * w / sqrt(mean(x[r]^2) + eps) for h % 4 == 0, h <= 16384; grid (rows), block 1024. Each thread
// loads its (up to 4) 16-byte pieces of the row at once and keeps them in registers; threads sum their pieces in
// order, warps reduce by butterfly, warp 0 sums the 32 warp totals in order: a fixed order for a given h.
#define NORM_PIECES 4
extern "C" __global__ void __launch_bounds__(1024) rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                                            float* __restrict__ out, int h, float eps) {
    __shared__ float partial[32];
    const int r = blockIdx.x;
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * h);
    const int pieces = h >> 2;
    float4 v[NORM_PIECES];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j] = i < pieces ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
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
    const float4* wr = reinterpret_cast<const float4*>(w);
    float4* o = reinterpret_cast<float4*>(out + (size_t)r * h);
#pragma unroll
    for (int j = 0; j < NORM_PIECES; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < pieces) {
            const float4 g = wr[i];
            o[i] = make_float4(v[j].x * scale * g.x, v[j].y * scale * g.y, v[j].z * scale * g.z, v[j].w * scale * g.w);
        }
    }
}

// y[r][c] = dot(x[r], W[c]) for a bf16 W of n rows x k columns (k % 8 == 0), m activation rows.
// grid (ceil(n / 16), ceil(m / ROWS), splits), block 128: each warp owns 4 output columns and up to ROWS activation
// rows. Lane l reads the 4 weight rows in 16-byte pieces l, l + 32, ... of its split's range (coalesced: a warp
// reads 512 contiguous bytes of each row per step, four independent loads in flight per lane) and each activation
// piece once for all 4 columns, keeping one partial sum per (row, column); a butterfly reduces each.
// Output, by mode:
//   splits > 1: the split's partial sums go to scratch[split][r][c]; splitk_reduce adds them up in split order.
//   silu_pairs: W's rows are (gate, up) pairs; y[r][c / 2] = silu(gate) * up (n even; pairs never straddle warps).
//   otherwise:  y[r][c] = sum, or y[r][c] += sum when accumulate (a residual add).
// The number of splits depends only on the matrix's shape, so a row's result never depends on m or on the other
// rows (batch invariance).
// ROWS (1, 2, 4 or 8) is how many activation rows one launch tile holds: the fewer, the fewer registers, the more
// warps in flight (a one-row decode step is the bandwidth-critical case). Every instantiation does the same
// arithmetic per row, so the choice never changes a result.
#define GEMV_COLS 4
template <int GEMV_ROWS>
__device__ __forceinline__ void gemv_tile(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k, int m, int accumulate, int splits,
                                          float* __restrict__ scratch, int silu_pairs) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (blockIdx.x * 4 + warp) * GEMV_COLS;
    const int r0 = blockIdx.y * GEMV_ROWS;
    if (c0 >= n) return;
    const int rows = min(GEMV_ROWS, m - r0);
    const int cols = min(GEMV_COLS, n - c0);
    const int pieces = k >> 3;
    const int per_split = (pieces + splits - 1) / splits;
    const int p_begin = blockIdx.z * per_split, p_end = min(pieces, p_begin + per_split);
    float acc[GEMV_ROWS][GEMV_COLS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
        for (int j = 0; j < GEMV_COLS; j++) acc[r][j] = 0.f;
    const uint4* wrows[GEMV_COLS];
#pragma unroll
    for (int j = 0; j < GEMV_COLS; j++) wrows[j] = reinterpret_cast<const uint4*>(w + (size_t)(c0 + min(j, cols - 1)) * k);
#pragma unroll 2
    for (int p = p_begin + lane; p < p_end; p += 32) {
        float wf[GEMV_COLS][8];
#pragma unroll
        for (int j = 0; j < GEMV_COLS; j++) {
            const uint4 packed = __ldg(wrows[j] + p);
            wf[j][0] = __uint_as_float(packed.x << 16); wf[j][1] = __uint_as_float(packed.x & 0xffff0000u);
            wf[j][2] = __uint_as_float(packed.y << 16); wf[j][3] = __uint_as_float(packed.y & 0xffff0000u);
            wf[j][4] = __uint_as_float(packed.z << 16); wf[j][5] = __uint_as_float(packed.z & 0xffff0000u);
            wf[j][6] = __uint_as_float(packed.w << 16); wf[j][7] = __uint_as_float(packed.w & 0xffff0000u);
        }
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            if (r < rows) {
                const float4* xr = reinterpret_cast<const float4*>(x + (size_t)(r0 + r) * k) + 2 * p;
                const float4 a = xr[0], b = xr[1];
                const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int j = 0; j < GEMV_COLS; j++) {
                    float s = acc[r][j];
#pragma unroll
                    for (int e = 0; e < 8; e++) s = fmaf(wf[j][e], xv[e], s);
                    acc[r][j] = s;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        if (r < rows) {
            float sums[GEMV_COLS];
#pragma unroll
            for (int j = 0; j < GEMV_COLS; j++) sums[j] = warp_sum(acc[r][j]);
            if (lane == 0) {
                const size_t row = (size_t)(r0 + r);
                if (splits > 1) {
                    for (int j = 0; j < cols; j++) scratch[((size_t)blockIdx.z * m + row) * n + c0 + j] = sums[j];
                } else if (silu_pairs) {
                    for (int j = 0; j + 1 < cols; j += 2) {
                        const float g = sums[j];
                        y[row * (n / 2) + (c0 + j) / 2] = g / (1.f + expf(-g)) * sums[j + 1];
                    }
                } else {
                    for (int j = 0; j < cols; j++) {
                        float* dst = y + row * n + c0 + j;
                        *dst = accumulate ? *dst + sums[j] : sums[j];
                    }
                }
            }
        }
    }
}

#define GEMV_KERNEL(name, ROWS)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        name(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n, int k, int m, \
             int accumulate, int splits, float* __restrict__ scratch, int silu_pairs) {                          \
        gemv_tile<ROWS>(w, x, y, n, k, m, accumulate, splits, scratch, silu_pairs);                              \
    }
GEMV_KERNEL(gemv_bf16_1, 1)
GEMV_KERNEL(gemv_bf16_2, 2)
GEMV_KERNEL(gemv_bf16_4, 4)
GEMV_KERNEL(gemv_bf16_8, 8)

// y[r][c] (+)= sum over splits, in split order, of scratch[split][r][c]; grid-stride over m * n.
extern "C" __global__ void splitk_reduce(const float* __restrict__ scratch, float* __restrict__ y, int n, int m,
                                         int splits, int accumulate) {
    const size_t total = (size_t)m * n;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        float s = 0.f;
        for (int z = 0; z < splits; z++) s += scratch[(size_t)z * total + i];
        y[i] = accumulate ? y[i] + s : s;
    }
}

// After the fused QKV GEMV: adds the biases, rotates queries and keys, writes the queries to q and the keys and
// values to the row's sequence cache. qkv[r] holds q (heads * hd), then k and v (kv_heads * hd each).
// grid (rows, heads + 2 * kv_heads), block 64.
extern "C" __global__ void qkv_post(const float* __restrict__ qkv, const float* __restrict__ bias, int has_bias,
                                    const float2* __restrict__ angles, const RowInfo* __restrict__ rows,
                                    const SeqCache* __restrict__ caches, int layer, int heads, int kv_heads, int hd,
                                    int halves, float* __restrict__ q) {
    const int r = blockIdx.x, seg = blockIdx.y, half = hd / 2;
    const int width = (heads + 2 * kv_heads) * hd;
    const float* src = qkv + (size_t)r * width + (size_t)seg * hd;
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
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const float2 a = angles[(size_t)r * half + i];
            const int ia = halves ? i : 2 * i, ib = halves ? i + half : 2 * i + 1;
            const float x0 = src[ia] + (b ? b[ia] : 0.f), x1 = src[ib] + (b ? b[ib] : 0.f);
            dst[ia] = x0 * a.y - x1 * a.x;
            dst[ib] = x0 * a.x + x1 * a.y;
        }
    } else {
        const int h = seg - heads - kv_heads;
        float* dst = sc.base + ((((size_t)layer * 2 + 1) * kv_heads + h) * sc.capacity + ri.slot) * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) dst[d] = src[d] + (b ? b[d] : 0.f);
    }
}

// angles[r][i] = (sin, cos)(positions[r] * inv_freq[i]), the angle in double precision (large positions times
// small frequencies lose precision in float). grid (rows), block 64.
extern "C" __global__ void rope_angles(const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                                       float2* __restrict__ angles, int half) {
    const int r = blockIdx.x;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double s, c;
        sincos((double)positions[r] * (double)inv_freq[i], &s, &c);
        angles[(size_t)r * half + i] = make_float2((float)s, (float)c);
    }
}

// Attention of row r, head h over its sequence's cache: slots 0..=slot, skipping new rows its tree mask hides.
// grid (rows, heads), block 128 (4 warps). Warp w takes the chunks of 32 slots w, w + 4, ... in order. In a
// chunk, lane j scores slot j (a dot product over the head dimension, every lane's key load in flight at once),
// the warp updates an online softmax with the chunk's max and sum, and then adds the chunk's values slot by slot
// (lanes split the head dimension, hd <= 256). Warp 0 merges the four warps in order. The order is fixed by slot
// numbers, so a row's result does not depend on the other rows of the launch.
#define ATT_WARPS 4
#define ATT_MAX_DIMS 8

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
extern "C" __global__ void __launch_bounds__(128) attention(const float* __restrict__ q, float* __restrict__ out,
                                                            const RowInfo* __restrict__ rows,
                                                            const SeqCache* __restrict__ caches, int layer,
                                                            int heads, int kv_heads, int hd, float scale) {
    __shared__ float s_max[ATT_WARPS], s_sum[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][32 * ATT_MAX_DIMS];
    __shared__ float s_q[32 * ATT_MAX_DIMS];
    const int r = blockIdx.x, head = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const RowInfo ri = rows[r];
    const SeqCache sc = caches[ri.seq];
    const int kvh = head / (heads / kv_heads);
    const float* keys = sc.base + (((size_t)layer * 2 + 0) * kv_heads + kvh) * sc.capacity * hd;
    const float* values = sc.base + (((size_t)layer * 2 + 1) * kv_heads + kvh) * sc.capacity * hd;
    const float* qh = q + ((size_t)r * heads + head) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) s_q[d] = qh[d];
    __syncthreads();
    float acc[ATT_MAX_DIMS];
#pragma unroll
    for (int j = 0; j < ATT_MAX_DIMS; j++) acc[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    // Keys are taken in "visible order": the cached context, then the row's ancestors among the new rows and
    // itself. For a chain that is slot order; a tree row skips the slots its mask hides, so its visible keys get
    // the same lanes and chunks as the same keys of its branch run as a chain (bitwise the same result).
    const int visible_count = ri.is_tree ? (int)ri.base + __popcll(ri.tree_mask) : (int)ri.slot + 1;
    for (int chunk = warp; chunk * 32 < visible_count; chunk += ATT_WARPS) {
        const int li = chunk * 32 + lane;
        const bool visible = li < visible_count;
        const int s = (!ri.is_tree || li < (int)ri.base) ? li : (int)ri.base + nth_set_bit(ri.tree_mask, li - (int)ri.base);
        float score = NEG_INF;
        if (visible) {
            const float4* k4 = reinterpret_cast<const float4*>(keys + (size_t)s * hd);
            float dot = 0.f;
            for (int d4 = 0; d4 < (hd >> 2); d4++) {
                const float4 kv = k4[d4];
                dot = fmaf(s_q[4 * d4], kv.x, dot);
                dot = fmaf(s_q[4 * d4 + 1], kv.y, dot);
                dot = fmaf(s_q[4 * d4 + 2], kv.z, dot);
                dot = fmaf(s_q[4 * d4 + 3], kv.w, dot);
            }
            score = dot * scale;
        }
        const float chunk_max = warp_max(score);
        if (chunk_max == NEG_INF) continue;
        const float m_new = fmaxf(m, chunk_max);
        const float correction = expf(m - m_new);
        const float p = visible ? expf(score - m_new) : 0.f;
        l = l * correction + warp_sum(p);
#pragma unroll
        for (int j = 0; j < ATT_MAX_DIMS; j++) acc[j] *= correction;
        const int count = min(32, visible_count - chunk * 32);
        // Unrolled without data-dependent branches, so the value loads of several slots are in flight at once
        // (one slot at a time left each iteration waiting on memory); the adds still happen in slot order.
#pragma unroll 8
        for (int t = 0; t < count; t++) {
            const float pt = __shfl_sync(0xffffffffu, p, t);
            const int st = __shfl_sync(0xffffffffu, s, t);
            const float* vs = values + (size_t)st * hd;
#pragma unroll
            for (int j = 0; j < ATT_MAX_DIMS; j++) {
                const int d = lane + 32 * j;
                if (d < hd) acc[j] = fmaf(pt, vs[d], acc[j]);
            }
        }
        m = m_new;
    }
    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ATT_MAX_DIMS; j++) s_acc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    if (warp == 0) {
        float gm = NEG_INF;
        for (int w = 0; w < ATT_WARPS; w++) gm = fmaxf(gm, s_max[w]);
        float gl = 0.f, total[ATT_MAX_DIMS];
#pragma unroll
        for (int j = 0; j < ATT_MAX_DIMS; j++) total[j] = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) {
            if (s_max[w] == NEG_INF) continue;
            const float f = expf(s_max[w] - gm);
            gl += s_sum[w] * f;
#pragma unroll
            for (int j = 0; j < ATT_MAX_DIMS; j++) total[j] += s_acc[w][lane + 32 * j] * f;
        }
        float* oh = out + ((size_t)r * heads + head) * hd;
#pragma unroll
        for (int j = 0; j < ATT_MAX_DIMS; j++) {
            const int d = lane + 32 * j;
            if (d < hd) oh[d] = total[j] / gl;
        }
    }
}

// out[j] = x[src[j]] for the rows that need logits; grid (rows), block 256.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ src,
                                       float* __restrict__ out, int h) {
    const int j = blockIdx.x;
    const float* from = x + (size_t)src[j] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[(size_t)j * h + i] = from[i];
}

// best[r] = the column of row r's largest value, the first one on ties (as the CPU's argmax). grid (rows),
// block 256.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, u32* __restrict__ best, int n) {
    __shared__ float s_val[256];
    __shared__ u32 s_idx[256];
    const int r = blockIdx.x;
    const float* row = x + (size_t)r * n;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float e = row[c];
        if (e > v || idx == 0xffffffffu) { v = e; idx = c; }
    }
    s_val[threadIdx.x] = v;
    s_idx[threadIdx.x] = idx;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float ov = s_val[threadIdx.x + stride];
            const u32 oi = s_idx[threadIdx.x + stride];
            if (ov > s_val[threadIdx.x] || (ov == s_val[threadIdx.x] && oi < s_idx[threadIdx.x])) {
                s_val[threadIdx.x] = ov;
                s_idx[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) best[r] = s_idx[0];
}

// Fills a bf16 buffer with seeded uniform values in [-scale, scale) (random weights of real shapes for speed
// work, made on the device). A counter-based hash, so any element's value depends only on (seed, index).
extern "C" __global__ void fill_random_bf16(bf16_t* __restrict__ out, size_t n, u64 seed, float scale) {
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
    float* head = cache + (size_t)blockIdx.x * capacity * hd;
    for (int j = 0; j < count; j++) {
        const float* from = head + (size_t)(base + src[j]) * hd;
        float* to = head + (size_t)(base + j) * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) to[d] = from[d];
        __syncthreads();
    }
}
