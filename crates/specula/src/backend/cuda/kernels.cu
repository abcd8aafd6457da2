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

// out[r][i] = table[tokens[r]][i], bf16 -> f32. grid (rows), block 256.
extern "C" __global__ void embed_rows(const bf16_t* __restrict__ table, const u32* __restrict__ tokens,
                                      float* __restrict__ out, int h) {
    const int r = blockIdx.x;
    const bf16_t* src = table + (size_t)tokens[r] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[(size_t)r * h + i] = bf16_to_f32(src[i]);
}

// out[r] = x[r] * w / sqrt(mean(x[r]^2) + eps); grid (rows), block 256 (8 warps). Threads sum strided elements
// in order, warps reduce by butterfly, warp 0 sums the 8 warp totals in order.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int h, float eps) {
    __shared__ float partial[32];
    const int r = blockIdx.x;
    const float* xr = x + (size_t)r * h;
    float s = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) s += xr[i] * xr[i];
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
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[(size_t)r * h + i] = xr[i] * scale * w[i];
}

// y[r][c] = dot(x[r], W[c]) (+ y[r][c] when accumulate) for a bf16 W of n rows x k columns (k % 8 == 0).
// grid (ceil(n / 16), ceil(m / 8)), block 128: each warp owns 4 output columns and up to 8 activation rows. Lane l
// reads the 4 weight rows in 16-byte pieces l, l + 32, ... (coalesced: a warp reads 512 contiguous bytes of each
// row per step, four independent loads in flight per lane) and each activation piece once for all 4 columns,
// keeping one partial sum per (row, column); a butterfly reduces each. A column's sum for a row depends only on
// k and that row, never on m or on the other rows.
#define GEMV_ROWS 8
#define GEMV_COLS 4
extern "C" __global__ void __launch_bounds__(128) gemv_bf16(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                                           float* __restrict__ y, int n, int k, int m,
                                                           int accumulate) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (blockIdx.x * 4 + warp) * GEMV_COLS;
    const int r0 = blockIdx.y * GEMV_ROWS;
    if (c0 >= n) return;
    const int rows = min(GEMV_ROWS, m - r0);
    const int cols = min(GEMV_COLS, n - c0);
    float acc[GEMV_ROWS][GEMV_COLS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
        for (int j = 0; j < GEMV_COLS; j++) acc[r][j] = 0.f;
    const int pieces = k >> 3;
    const uint4* wrows[GEMV_COLS];
#pragma unroll
    for (int j = 0; j < GEMV_COLS; j++) wrows[j] = reinterpret_cast<const uint4*>(w + (size_t)(c0 + min(j, cols - 1)) * k);
    for (int p = lane; p < pieces; p += 32) {
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
#pragma unroll
            for (int j = 0; j < GEMV_COLS; j++) {
                const float s = warp_sum(acc[r][j]);
                if (lane == 0 && j < cols) {
                    float* dst = y + (size_t)(r0 + r) * n + c0 + j;
                    *dst = accumulate ? *dst + s : s;
                }
            }
        }
    }
}

// y[r][c] += b[c]; grid (rows), block 256.
extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ b, int n) {
    const int r = blockIdx.x;
    for (int c = threadIdx.x; c < n; c += blockDim.x) y[(size_t)r * n + c] += b[c];
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

// Rotates every head of x[r] (heads * hd values) by its row's angles: pairs (i, i + hd/2) when halves, else
// (2i, 2i + 1). grid (rows, heads), block 64.
extern "C" __global__ void rope_apply(float* __restrict__ x, const float2* __restrict__ angles, int heads, int hd,
                                      int halves) {
    const int r = blockIdx.x, head = blockIdx.y, half = hd / 2;
    float* xh = x + ((size_t)r * heads + head) * hd;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float2 sc = angles[(size_t)r * half + i];
        const int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
        const float x0 = xh[a], x1 = xh[b];
        xh[a] = x0 * sc.y - x1 * sc.x;
        xh[b] = x0 * sc.x + x1 * sc.y;
    }
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

// Writes row r's keys and values (kv_heads * hd each) of `layer` into its sequence's cache at its slot.
// grid (rows), block 128.
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                    const RowInfo* __restrict__ rows, const SeqCache* __restrict__ caches, int layer,
                                    int kv_heads, int hd) {
    const int r = blockIdx.x;
    const RowInfo ri = rows[r];
    const SeqCache sc = caches[ri.seq];
    const int kv_dim = kv_heads * hd;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        const int h = i / hd, d = i % hd;
        const size_t kidx = ((((size_t)layer * 2 + 0) * kv_heads + h) * sc.capacity + ri.slot) * hd + d;
        const size_t vidx = ((((size_t)layer * 2 + 1) * kv_heads + h) * sc.capacity + ri.slot) * hd + d;
        sc.base[kidx] = k[(size_t)r * kv_dim + i];
        sc.base[vidx] = v[(size_t)r * kv_dim + i];
    }
}

// Attention of row r, head h over its sequence's cache: slots 0..=slot, skipping new rows its tree mask hides.
// grid (rows, heads), block 128 (4 warps). Warp w takes the slots of chunks w, w + 4, ... (chunks of 32 slots, in
// order), one slot at a time: the lanes split the head dimension (hd <= 256), a butterfly gives the score, and an
// online softmax keeps (max, sum, weighted values). Warp 0 then merges the four warps in order. The chunking is
// fixed by slot numbers, so a row's result does not depend on the other rows of the launch.
#define ATT_WARPS 4
#define ATT_MAX_DIMS 8
extern "C" __global__ void __launch_bounds__(128) attention(const float* __restrict__ q, float* __restrict__ out,
                                                            const RowInfo* __restrict__ rows,
                                                            const SeqCache* __restrict__ caches, int layer,
                                                            int heads, int kv_heads, int hd, float scale) {
    __shared__ float s_max[ATT_WARPS], s_sum[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][32 * ATT_MAX_DIMS];
    const int r = blockIdx.x, head = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const RowInfo ri = rows[r];
    const SeqCache sc = caches[ri.seq];
    const int kvh = head / (heads / kv_heads);
    const float* keys = sc.base + (((size_t)layer * 2 + 0) * kv_heads + kvh) * sc.capacity * hd;
    const float* values = sc.base + (((size_t)layer * 2 + 1) * kv_heads + kvh) * sc.capacity * hd;
    const float* qh = q + ((size_t)r * heads + head) * hd;
    float qv[ATT_MAX_DIMS], acc[ATT_MAX_DIMS];
#pragma unroll
    for (int j = 0; j < ATT_MAX_DIMS; j++) {
        const int d = lane + 32 * j;
        qv[j] = d < hd ? qh[d] : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const int last = ri.slot;
    for (int chunk = warp; chunk * 32 <= last; chunk += ATT_WARPS) {
        const int end = min(chunk * 32 + 32, last + 1);
        for (int s = chunk * 32; s < end; s++) {
            if (ri.is_tree && s >= (int)ri.base && !((ri.tree_mask >> (s - ri.base)) & 1ull)) continue;
            const float* ks = keys + (size_t)s * hd;
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < ATT_MAX_DIMS; j++) {
                const int d = lane + 32 * j;
                if (d < hd) dot = fmaf(qv[j], ks[d], dot);
            }
            const float score = warp_sum(dot) * scale;
            const float m_new = fmaxf(m, score);
            const float correction = expf(m - m_new);
            const float p = expf(score - m_new);
            l = l * correction + p;
            const float* vs = values + (size_t)s * hd;
#pragma unroll
            for (int j = 0; j < ATT_MAX_DIMS; j++) {
                const int d = lane + 32 * j;
                acc[j] = acc[j] * correction + (d < hd ? p * vs[d] : 0.f);
            }
            m = m_new;
        }
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

// gate[i] = silu(gate[i]) * up[i]; grid-stride.
extern "C" __global__ void silu_mul(float* __restrict__ gate, const float* __restrict__ up, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = gate[i];
        gate[i] = g / (1.f + expf(-g)) * up[i];
    }
}

// x[i] += y[i]; grid-stride.
extern "C" __global__ void add_in_place(float* __restrict__ x, const float* __restrict__ y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
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
