// MLA attention over selected tokens only (the DSA selection): one block per (query, head).
// The same kernel serves absorbed decode (every head attends over the shared latent, which is
// both key and value) and expanded prefill (per-head keys and values from kv_b): the caller
// says where a token's key and value sit. Scores go to a per-row scratch row, the softmax and
// the weighted sum follow in selection order, so results repeat bit for bit. Also the
// weight absorption of queries and outputs on an f32 copy of kv_b, and the store of new rows
// into a cache in its format.
#include "common.cuh"

#define ATTN_MAX_DK 1024

// Block-wide max and sum; every thread gets the result. Fixed reduction order.
__device__ float attn_block_reduce(float v, bool is_max) {
    __shared__ float part[32];
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) part[wid] = v;
    __syncthreads();
    const int warps = (blockDim.x + WARP - 1) / WARP;
    const float none = is_max ? __int_as_float(0xff800000) : 0.0f;
    float total = lane < warps ? part[lane] : none;
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, total, o);
        total = is_max ? fmaxf(total, other) : total + other;
    }
    __syncthreads();
    return total;
}

// Rows pushed onto a sequence cache: src's n values become the cache's values at .. at + n,
// f32 as they are, bf16 and f16 rounded to nearest even. One thread per value. With `step`
// (a replayed decode graph's steps since its capture, on the device), the values go
// `*step * n` further on: each step pushes n values.
extern "C" __global__ void cache_store(const float* __restrict__ src, u8* __restrict__ cache,
                                       int fmt, i64 at, i64 n, const int* __restrict__ step) {
    grid_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 base = step ? at + (i64)*step * n : at;
    cache_put(cache, base + i, fmt, src[i]);
}

// A decode graph's batched attention offsets: query s's selection is its sequence's own,
// planned on the device (offsets of[s][0 .. 2]); sel_off gets them as one list (n + 1 values).
extern "C" __global__ void sel_offsets_gather(const unsigned long long* __restrict__ of, int n,
                                              int* __restrict__ sel_off) {
    grid_wait();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int off = 0;
    sel_off[0] = 0;
    for (int s = 0; s < n; s++) {
        const int* o = (const int*)of[s];
        off += o[1] - o[0];
        sel_off[s + 1] = off;
    }
}

// q: [queries * heads, dk] (row = query * heads + head). Token j's key for head h is dk
// values at kv + j * stride + h * head_step + k_off, its value dv values at ... + v_off;
// kv holds values of format kv_fmt (cache_load).
// picks: query i's tokens are picks[sel_off[i] .. sel_off[i + 1]]. scratch:
// [queries * heads, max_picks]. out: [queries * heads, dv]. blockDim a multiple of 32.
// kv_of and picks_of (both null, or both set: queries of several sequences in one launch):
// query i reads the cache at kv_of[i] and its sel_off[i + 1] - sel_off[i] tokens from
// picks_of[i] on, instead of kv and picks + sel_off[i]; the arithmetic is the same.
extern "C" __global__ void mla_sparse_attend(const float* __restrict__ q,
                                             const u8* __restrict__ kv, int kv_fmt,
                                             const u32* __restrict__ picks,
                                             const int* __restrict__ sel_off, int heads, int dk,
                                             int dv, i64 stride, i64 head_step, i64 k_off,
                                             i64 v_off, float scale, int max_picks,
                                             float* __restrict__ scratch,
                                             float* __restrict__ out,
                                             const unsigned long long* __restrict__ kv_of,
                                             const unsigned long long* __restrict__ picks_of) {
    grid_wait();
    __shared__ float qs[ATTN_MAX_DK];
    const int row = blockIdx.x;
    const int query = row / heads, head = row % heads;
    const int first = sel_off[query], n = sel_off[query + 1] - first;
    const u8* src = kv_of ? (const u8*)kv_of[query] : kv;
    const u32* sel = kv_of ? (const u32*)picks_of[query] : picks + first;
    const int tid = threadIdx.x, lane = tid & (WARP - 1), wid = tid / WARP;
    const int warps = blockDim.x / WARP;
    for (int c = tid; c < dk; c += blockDim.x) qs[c] = q[(i64)row * dk + c];
    __syncthreads();

    float* sc = scratch + (i64)row * max_picks;
    const i64 head_base = (i64)head * head_step;
    // One warp per selected token: its score.
    for (int j = wid; j < n; j += warps) {
        const i64 k = (i64)sel[j] * stride + head_base + k_off;
        float acc = 0.0f;
        for (int c = lane; c < dk; c += WARP) acc = fmaf(qs[c], cache_load(src, k + c, kv_fmt), acc);
        acc = warp_sum(acc);
        if (lane == 0) sc[j] = acc * scale;
    }
    __syncthreads();

    // Softmax in place; each thread touches the same entries in all three passes.
    float m = __int_as_float(0xff800000);
    for (int j = tid; j < n; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = attn_block_reduce(m, true);
    float s = 0.0f;
    for (int j = tid; j < n; j += blockDim.x) {
        const float e = expf(sc[j] - m);
        sc[j] = e;
        s += e;
    }
    s = attn_block_reduce(s, false);
    for (int j = tid; j < n; j += blockDim.x) sc[j] = __fdiv_rn(sc[j], s);
    __syncthreads();

    // Weighted sum of the values in selection order, one thread per output channel.
    for (int c = tid; c < dv; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) {
            const i64 v = (i64)sel[j] * stride + head_base + v_off;
            acc = __fadd_rn(acc, __fmul_rn(sc[j], cache_load(src, v + c, kv_fmt)));
        }
        out[(i64)row * dv + c] = acc;
    }
}

// Absorbed MLA over a prompt chunk: the latent row is every head's key and value, and a
// query's selection is shared by its heads, so one block takes a query and up to SH_HEADS
// heads (grid y over head tiles) and reads each selected row once for all of them, where
// mla_sparse_attend reads it once per head. Three phases: scores in tiles of SH_HEADS heads x
// SH_TOK tokens (4 heads x 8 tokens a thread, SH_CK channels staged at a time) into the
// scratch rows; the softmax of each head's row (a warp a row); the weighted sum in passes of
// SH_DV channels over SH_VT tokens at a time, in selection order for each output. q is
// `[queries, heads, d]`, token j's row the d values at kv + j * stride; scratch and out as
// mla_sparse_attend's. blockDim 256. A query's results do not depend on the other queries of
// the launch. Each step's tiles come through registers (ShScoreTiles, ShSumTiles: 16-byte
// loads, the next step's in flight while the block computes on the current one); d, stride and
// max_picks are multiples of 4.
#define SH_HEADS 64
#define SH_TOK 128
#define SH_CK 32
#define SH_VT 32
#define SH_DV 128
#define SH_QPAD (SH_HEADS + 4)
#define SH_KPAD (SH_TOK + 4)

__device__ __forceinline__ void sh_fma_4x8(float (&acc)[4][8], const float4 a, const float4 b0,
                                           const float4 b1) {
    const float av[4] = {a.x, a.y, a.z, a.w};
    const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[i][k] = fmaf(av[i], bv[k], acc[i][k]);
}

// Four values of a sequence cache from index i (a multiple of 4) as f32: one 16-byte load of
// f32, one 8-byte load of bf16 / f16.
__device__ __forceinline__ float4 cache_load4(const u8* __restrict__ cache, i64 i, int fmt) {
    if (fmt == FMT_F32) return *(const float4*)((const float*)cache + i);
    const uint2 h = *(const uint2*)((const u16*)cache + i);
    const u16 v[4] = {(u16)(h.x & 0xFFFF), (u16)(h.x >> 16), (u16)(h.y & 0xFFFF), (u16)(h.y >> 16)};
    float f[4];
#pragma unroll
    for (int e = 0; e < 4; e++) f[e] = fmt == FMT_BF16 ? bf16_to_f32(v[e]) : f16_to_f32(v[e]);
    return make_float4(f[0], f[1], f[2], f[3]);
}

__device__ __forceinline__ float f4_at(const float4 v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// The operands of one step of mla_attend_shared's loops, staged through registers: each thread
// loads its share of the next tiles (16-byte loads, all in flight at once) while the block
// computes on the current ones in shared memory, then stores them there. d, the cache's row
// stride and max_picks are multiples of 4 (the host's condition for this kernel).
// Scores: a chunk of SH_CK channels of SH_HEADS query heads (2 float4 a thread: head i / 8,
// channels 4 (i % 8) ..) and of SH_TOK selected tokens' rows (4 float4: token i / 8).
struct ShScoreTiles {
    float4 q[2], k[4];
};

__device__ __forceinline__ void sh_fetch_scores(ShScoreTiles& r, const float* __restrict__ qb,
                                                int hn, int d, const u8* __restrict__ kv,
                                                int kv_fmt, const i64* rows, int c0) {
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int i = threadIdx.x + 256 * j, h = i / 8, c = c0 + 4 * (i % 8);
        r.q[j] = h < hn && c < d ? *(const float4*)(qb + (i64)h * d + c) : zero;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = threadIdx.x + 256 * j, t = i / 8, c = c0 + 4 * (i % 8);
        r.k[j] = rows[t] >= 0 && c < d ? cache_load4(kv, rows[t] + c, kv_fmt) : zero;
    }
}

// A thread's 2 float4 of a per-head tile (head i / 8, values 4 (i % 8) ..) into qs, value-major.
__device__ __forceinline__ void sh_store_heads(const float4 (&v)[2], float* qs) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int i = threadIdx.x + 256 * j, h = i / 8, c = 4 * (i % 8);
#pragma unroll
        for (int e = 0; e < 4; e++) qs[(c + e) * SH_QPAD + h] = f4_at(v[j], e);
    }
}

__device__ __forceinline__ void sh_store_scores(const ShScoreTiles& r, float* qs, float* ks) {
    sh_store_heads(r.q, qs);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = threadIdx.x + 256 * j, t = i / 8, c = 4 * (i % 8);
#pragma unroll
        for (int e = 0; e < 4; e++) ks[(c + e) * SH_KPAD + t] = f4_at(r.k[j], e);
    }
}

// Weighted sum: SH_VT selected tokens' probabilities for SH_HEADS heads (2 float4 a thread:
// head i / 8, tokens 4 (i % 8) ..; zero past the selection) and their rows' SH_DV value
// channels from v0 (4 float4: token i / 32, channels 4 (i % 32) ..).
struct ShSumTiles {
    float4 p[2], v[4];
};

__device__ __forceinline__ void sh_fetch_sums(ShSumTiles& r, const float* sc, int max_picks,
                                              int hn, int n, int d, const u8* __restrict__ kv,
                                              int kv_fmt, const u32* __restrict__ sel,
                                              i64 stride, int j0, int v0) {
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int i = threadIdx.x + 256 * j, h = i / 8, t = j0 + 4 * (i % 8);
        float4 p = zero;
        if (h < hn && t < n) {
            p = *(const float4*)(sc + (i64)h * max_picks + t);
            // Past the selection the scratch row holds no probabilities.
            if (t + 1 >= n) p.y = 0.0f;
            if (t + 2 >= n) p.z = 0.0f;
            if (t + 3 >= n) p.w = 0.0f;
        }
        r.p[j] = p;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = threadIdx.x + 256 * j, t = j0 + i / 32, c = v0 + 4 * (i % 32);
        r.v[j] = t < n && c < d ? cache_load4(kv, (i64)sel[t] * stride + c, kv_fmt) : zero;
    }
}

__device__ __forceinline__ void sh_store_sums(const ShSumTiles& r, float* qs, float* ks) {
    sh_store_heads(r.p, qs);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = threadIdx.x + 256 * j;
        *(float4*)&ks[(i / 32) * SH_KPAD + 4 * (i % 32)] = r.v[j];
    }
}

extern "C" __global__ void __launch_bounds__(256) mla_attend_shared(const float* __restrict__ q, const u8* __restrict__ kv, int kv_fmt,
                      const u32* __restrict__ picks, const int* __restrict__ sel_off,
                      int heads, int d, i64 stride, float scale, int max_picks,
                      float* __restrict__ scratch, float* __restrict__ out) {
    grid_wait();
    // Phase 1: qs [SH_CK][SH_QPAD] query channels, ks [SH_CK][SH_KPAD] token channels;
    // phase 3: qs [SH_VT][SH_QPAD] probabilities, ks [SH_VT][SH_KPAD] value channels.
    __shared__ __align__(16) float qs[SH_CK * SH_QPAD];
    __shared__ __align__(16) float ks[SH_CK * SH_KPAD];
    // The current token tile's row offsets in the cache (-1 past the selection).
    __shared__ i64 rows[SH_TOK];
    const int query = blockIdx.x, h0 = blockIdx.y * SH_HEADS;
    const int first = sel_off[query], n = sel_off[query + 1] - first;
    const int hn = min(SH_HEADS, heads - h0);
    const int tid = threadIdx.x, th = tid / 16, tt = tid % 16;
    const float* qb = q + ((i64)query * heads + h0) * d;
    float* sc = scratch + ((i64)query * heads + h0) * max_picks;
    const u32* sel = picks + first;

    for (int j0 = 0; j0 < n; j0 += SH_TOK) {
        __syncthreads();
        for (int t = tid; t < SH_TOK; t += blockDim.x)
            rows[t] = j0 + t < n ? (i64)sel[j0 + t] * stride : -1;
        __syncthreads();
        ShScoreTiles next;
        sh_fetch_scores(next, qb, hn, d, kv, kv_fmt, rows, 0);
        float acc[4][8] = {};
        for (int c0 = 0; c0 < d; c0 += SH_CK) {
            __syncthreads();
            sh_store_scores(next, qs, ks);
            __syncthreads();
            if (c0 + SH_CK < d) sh_fetch_scores(next, qb, hn, d, kv, kv_fmt, rows, c0 + SH_CK);
#pragma unroll 4
            for (int c = 0; c < SH_CK; c++) {
                const float4 a = *(const float4*)&qs[c * SH_QPAD + th * 4];
                const float4 b0 = *(const float4*)&ks[c * SH_KPAD + tt * 4];
                const float4 b1 = *(const float4*)&ks[c * SH_KPAD + SH_TOK / 2 + tt * 4];
                sh_fma_4x8(acc, a, b0, b1);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int h = th * 4 + i;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int t = j0 + (k < 4 ? tt * 4 + k : SH_TOK / 2 + tt * 4 + k - 4);
                if (h < hn && t < n) sc[(i64)h * max_picks + t] = acc[i][k] * scale;
            }
        }
    }
    __syncthreads();

    const int lane = tid & (WARP - 1), wid = tid / WARP, warps = blockDim.x / WARP;
    for (int h = wid; h < hn; h += warps) {
        float* row = sc + (i64)h * max_picks;
        float m = __int_as_float(0xff800000);
        for (int j = lane; j < n; j += WARP) m = fmaxf(m, row[j]);
        for (int o = WARP / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float s = 0.0f;
        for (int j = lane; j < n; j += WARP) {
            const float e = expf(row[j] - m);
            row[j] = e;
            s += e;
        }
        s = warp_sum(s);
        for (int j = lane; j < n; j += WARP) row[j] = __fdiv_rn(row[j], s);
    }

    for (int v0 = 0; v0 < d; v0 += SH_DV) {
        float acc[4][8] = {};
        ShSumTiles next;
        __syncthreads();  // the softmax's rows, or the last pass's tiles, are done with
        if (n > 0) sh_fetch_sums(next, sc, max_picks, hn, n, d, kv, kv_fmt, sel, stride, 0, v0);
        for (int j0 = 0; j0 < n; j0 += SH_VT) {
            __syncthreads();
            sh_store_sums(next, qs, ks);
            __syncthreads();
            if (j0 + SH_VT < n)
                sh_fetch_sums(next, sc, max_picks, hn, n, d, kv, kv_fmt, sel, stride, j0 + SH_VT, v0);
#pragma unroll 4
            for (int jj = 0; jj < SH_VT; jj++) {
                const float4 a = *(const float4*)&qs[jj * SH_QPAD + th * 4];
                const float4 b0 = *(const float4*)&ks[jj * SH_KPAD + tt * 4];
                const float4 b1 = *(const float4*)&ks[jj * SH_KPAD + SH_DV / 2 + tt * 4];
                sh_fma_4x8(acc, a, b0, b1);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int h = th * 4 + i;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int c = v0 + (k < 4 ? tt * 4 + k : SH_DV / 2 + tt * 4 + k - 4);
                if (h < hn && c < d) out[((i64)query * heads + h0 + h) * d + c] = acc[i][k];
            }
        }
    }
}

// MLA absorption of the query (mla.rs `attend_absorbed`): per head,
// q_lat[head][c] = sum_{i < nope} q[head][i] * kv_b[head * (nope + vd) + i][c], summed in
// order of i as the CPU's axpy loop. kv_b is f32 `[heads * (nope + vd), rank]`; one thread
// per (head, c): grid x over rank, grid y over heads, grid z over tokens (q is
// `[tokens, heads, nope]`, q_lat `[tokens, heads, rank]`).
extern "C" __global__ void mla_absorb_q(const float* __restrict__ q,
                                        const float* __restrict__ kv_b, int nope, int vd,
                                        int rank, float* __restrict__ q_lat) {
    grid_wait();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int head = blockIdx.y;
    if (c >= rank) return;
    q += (i64)blockIdx.z * gridDim.y * nope;
    q_lat += (i64)blockIdx.z * gridDim.y * rank;
    const float* qh = q + (i64)head * nope;
    const float* w = kv_b + (i64)head * (nope + vd) * rank + c;
    float acc = 0.0f;
    for (int i = 0; i < nope; i++) acc += qh[i] * w[(i64)i * rank];
    q_lat[(i64)head * rank + c] = acc;
}

// MLA absorption of the output: out[head][v] = kv_b[head * (nope + vd) + nope + v] .
// o_lat[head]. One warp per output row (heads * vd rows), grid y over tokens (o_lat is
// `[tokens, heads, rank]`, out `[tokens, heads * vd]`).
extern "C" __global__ void mla_absorb_out(const float* __restrict__ o_lat,
                                          const float* __restrict__ kv_b, int heads, int nope,
                                          int vd, int rank, float* __restrict__ out) {
    grid_wait();
    const int warps = blockDim.x / WARP;
    const int r = blockIdx.x * warps + threadIdx.x / WARP;
    if (r >= heads * vd) return;
    o_lat += (i64)blockIdx.y * heads * rank;
    out += (i64)blockIdx.y * heads * vd;
    const int head = r / vd, v = r % vd;
    const float* w = kv_b + ((i64)head * (nope + vd) + nope + v) * rank;
    const float* o = o_lat + (i64)head * rank;
    float acc = 0.0f;
    for (int i = threadIdx.x & (WARP - 1); i < rank; i += WARP) acc = fmaf(w[i], o[i], acc);
    acc = warp_sum(acc);
    if ((threadIdx.x & (WARP - 1)) == 0) out[r] = acc;
}
