// Shared device helpers for every glmflash kernel file. Self-contained (no CUDA headers),
// so NVRTC compiles it with no include path and nvcc with -I kernels/cuda.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// Weight formats; the numbers match the Rust side's `kernel_format_id`.
#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q8_0 3
#define FMT_Q4_K 4

// Programmatic dependent launch (the knob PDL=1, sm_90 and later; the host then makes the
// step graph's edges between two of these kernels programmatic): a kernel may be started while
// the one before it finishes, so every kernel begins with `grid_wait`, which returns once the
// kernels before it have completed and their writes are visible, and touches no memory
// before it. It then lets the kernel after it be started (`launch_dependents`). Launched any
// other way, or with PDL unset, it does nothing.
#ifndef PDL
#define PDL 0
#endif
__device__ __forceinline__ void grid_wait() {
#if PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

#define WARP 32
// Tokens one warp carries through a row at once (accumulators in registers).
#define TOK_TILE 8

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Value i of a sequence cache (MLA latents, DSA indexer keys) stored as FMT_F32, FMT_BF16 or
// FMT_F16, widened to f32.
__device__ __forceinline__ float cache_load(const u8* __restrict__ cache, i64 i, int fmt) {
    if (fmt == FMT_F32) return ((const float*)cache)[i];
    const u16 h = ((const u16*)cache)[i];
    return fmt == FMT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

__device__ __forceinline__ u16 load_u16(const u8* p) {
    return (u16)p[0] | ((u16)p[1] << 8);
}

// f32 to bf16 rounded to nearest even, NaN kept quiet: `half`'s bf16::from_f32 bit for bit.
__device__ __forceinline__ u16 f32_to_bf16_rn(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    const u32 round_bit = 0x8000u;
    const u16 hi = (u16)(x >> 16);
    return ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) ? (u16)(hi + 1) : hi;
}

// Stores v as value i of a sequence cache in format fmt: f32 as it is, bf16 and f16 rounded to
// nearest even (what `half`'s from_f32 gives on the host).
__device__ __forceinline__ void cache_put(u8* __restrict__ cache, i64 i, int fmt, float v) {
    if (fmt == FMT_F32) {
        ((float*)cache)[i] = v;
    } else if (fmt == FMT_BF16) {
        ((u16*)cache)[i] = f32_to_bf16_rn(v);
    } else {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        ((u16*)cache)[i] = h;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide sum (blockDim a multiple of 32, at most 1024); every thread gets the total. Fixed reduction order: results repeat.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    v = warp_sum(v);
    if (lane == 0) part[wid] = v;
    __syncthreads();
    const int warps = (blockDim.x + WARP - 1) / WARP;
    float total = lane < warps ? part[lane] : 0.0f;
    total = warp_sum(total);
    __syncthreads();
    return total;
}

// Whether this block is the last of `expected` blocks sharing `ticket` to get here: each
// block calls it (every thread) after writing its partial results; exactly one gets true, and
// it may then read every block's partials (through __ldcg: not from a stale L1). The last
// block puts the ticket back to zero, so the next launch on the stream finds it so.
__device__ bool last_of_group(u32* ticket, u32 expected) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(ticket, 1u) == expected - 1;
        if (last) atomicExch(ticket, 0u);
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Bytes of one row of `cols` values in format `fmt` (cols a multiple of the block size
// for the block formats; the host checks).
__device__ __forceinline__ i64 row_bytes(int fmt, int cols) {
    switch (fmt) {
        case FMT_F32: return (i64)cols * 4;
        case FMT_F16:
        case FMT_BF16: return (i64)cols * 2;
        case FMT_Q8_0: return (i64)(cols / 32) * 34;
        default: return (i64)(cols / 256) * 144;
    }
}

// Q8_0 block b of a row (f16 scale then 32 int8): lane l takes value l; row_dots' step.
template <int TILE>
__device__ __forceinline__ void q8_0_block_dots(const u8* __restrict__ w, int b,
                                                const float* __restrict__ x, i64 ldx, int nt,
                                                float* acc) {
    const int lane = threadIdx.x & (WARP - 1);
    const u8* blk = w + (i64)b * 34;
    float d = f16_to_f32(load_u16(blk));
    float v = d * (float)(signed char)blk[2 + lane];
    const int i = b * 32 + lane;
#pragma unroll
    for (int t = 0; t < TILE; t++)
        if (t < nt) acc[t] = fmaf(v, x[t * ldx + i], acc[t]);
}

// The scale and offset of the two sub-blocks of 32-byte quant chunk c (2c: low nibbles,
// 2c + 1: high) of a Q4_K super-block from its header words: value = ds * q - dm.
__device__ __forceinline__ void q4_k_chunk_scales(const u32 (&head)[4], int c, float (&ds)[2],
                                                  float (&dm)[2]) {
    const u32 dd = head[0];
    const float d = f16_to_f32((u16)(dd & 0xFFFF));
    const float dmin = f16_to_f32((u16)(dd >> 16));
    // Scale byte i is byte i % 4 of word 1 + i / 4.
    const u32 s0 = head[1], s1 = head[2], s2 = head[3];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = 2 * c + h, sh = 8 * (j & 3);
        // s[j & 3], s[4 + (j & 3)], s[8 + (j & 3)]: for j < 4 s[j] and s[j + 4]; for j >= 4
        // s[j - 4], s[j] and s[j + 4]. (j < 4 is lanes 0-15: a select of both forms instead of
        // the branch made a decode step's 8 q4_k picks 19% slower on the H100.)
        const u32 lo4 = (s0 >> sh) & 0xFF, mid = (s1 >> sh) & 0xFF, hi4 = (s2 >> sh) & 0xFF;
        u32 sc, m;
        if (j < 4) {
            sc = lo4 & 63;
            m = mid & 63;
        } else {
            sc = (hi4 & 0x0F) | ((lo4 >> 6) << 4);
            m = (hi4 >> 4) | ((mid >> 6) << 4);
        }
        ds[h] = d * (float)sc;
        dm[h] = dmin * (float)m;
    }
}

// One lane's raw share of a super-block: its 16-byte header and its 16 bytes of quants.
// Copies 16 bytes from global memory to shared-space address `at` without passing through
// registers (sm_80+); done for this thread at a `cp_async_wait` that covers its group.
__device__ __forceinline__ void cp_async16(u32 at, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 16 bytes of shared memory at shared-space address `at` (a `cp_async16` target).
__device__ __forceinline__ uint4 ld_shared16(u32 at) {
    uint4 q;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                 : "r"(at));
    return q;
}

struct Q4kRaw {
    u32 head[4], q[4];
};

// This lane's header and quants of super-block b of row w (q4_k_lane32_dots' chunk c, half h),
// as one 16-byte load each with V, else as 4-byte loads.
template <bool V>
__device__ __forceinline__ void q4_k_lane32_load(const u8* w, int b, Q4kRaw& raw) {
    const int lane = threadIdx.x & (WARP - 1);
    const int c = (lane & 7) >> 1, h = lane & 1;
    const u8* blk = w + (i64)b * 144;
    const u8* qp = blk + 16 + 32 * c + 16 * h;
    if constexpr (V) {
        const uint4 hv = *(const uint4*)blk, qv = *(const uint4*)qp;
        raw.head[0] = hv.x, raw.head[1] = hv.y, raw.head[2] = hv.z, raw.head[3] = hv.w;
        raw.q[0] = qv.x, raw.q[1] = qv.y, raw.q[2] = qv.z, raw.q[3] = qv.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            raw.head[i] = ((const u32*)blk)[i];
            raw.q[i] = ((const u32*)qp)[i];
        }
    }
}

// Where the four values 64 c + 32 p + 16 h + 4 k .. + 3 of super-block b of a row of x lie
// (q4_k_lane32_dots' chunk c, half h, step k; p: the low nibbles' values 0, the high ones' 1): in
// order (XL false), or in lane-of-32 order (XL), where step k's low (then high) values of the
// eight lanes of a super-block are eight float4s in a row, (2 k + p) * 8 + 2 c + h: a warp's
// load of them touches four 128-byte lines, not sixteen. `lane32_x` writes that order.
template <bool XL>
__device__ __forceinline__ i64 lane32_x_at(int b, int c, int h, int k, int p) {
    return (i64)b * 256 +
           (XL ? 4 * ((2 * k + p) * 8 + 2 * c + h) : 64 * c + 32 * p + 16 * h + 4 * k);
}

// Where value i of a row (of a multiple of 256 values) lies in lane-of-32 order.
__device__ __forceinline__ i64 lane32_x_pos(i64 i) {
    const int f = (int)(i & 255);
    return (i - f) + lane32_x_at<true>(0, f >> 6, (f >> 4) & 1, (f >> 2) & 3, (f >> 5) & 1) +
           (f & 3);
}

// Q4_K's step: lane l takes 32 values of one super-block of each group of four (super-block
// l / 8 of the group, 32-byte quant chunk c = (l % 8) / 2, its half h = l % 2), its header's
// scales decoded once for them: this lane's 32 values of super-block b of each of R rows
// (`raw`, loaded by q4_k_lane32_load) against
// `nt` <= TILE token rows of x, added into acc[r * TILE + t]: for each of its 16 quant bytes in
// order, the low nibble (value 64c + 16h + i, sub-block 2c) then the high (32 later, sub-block
// 2c + 1). The rows share each x value a lane loads (R x fewer loads of x), and each row's sums
// take the products in the order one row alone takes them: the same bits for any R. With V
// (the rows and x 16-byte aligned, x's stride a multiple of four) the quants and header come as
// one 16-byte load each and x as float4s; the products and their order are the same either way.
// With XL, x's rows are in lane-of-32 order (lane32_x_at): the same values from other addresses.
template <int TILE, bool V, int R = 1, bool XL = false>
__device__ __forceinline__ void q4_k_lane32_dots(const Q4kRaw* raw, int b,
                                                 const float* __restrict__ x, i64 ldx, int nt,
                                                 float* acc) {
    const int lane = threadIdx.x & (WARP - 1);
    const int c = (lane & 7) >> 1, h = lane & 1;
    float ds[R][2], dm[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) q4_k_chunk_scales(raw[r].head, c, ds[r], dm[r]);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        // This lane's values 64 c + 16 h + 4 k .. + 3 (low nibbles) and 32 later (high).
        const i64 lo_at = lane32_x_at<XL>(b, c, h, k, 0), hi_at = lane32_x_at<XL>(b, c, h, k, 1);
        float4 xl[TILE], xh[TILE];
        if constexpr (V) {
#pragma unroll
            for (int t = 0; t < TILE; t++) {
                if (t < nt) {
                    xl[t] = *(const float4*)(x + t * ldx + lo_at);
                    xh[t] = *(const float4*)(x + t * ldx + hi_at);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            // The four low and the four high nibbles, each picked into a word by a byte permute.
            const u32 lo4 = raw[r].q[k] & 0x0F0F0F0Fu, hi4 = (raw[r].q[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float ql =
                    __int_as_float(__byte_perm(lo4, 0x4B000000u, 0x7540 + e)) - 8388608.0f;
                const float qh =
                    __int_as_float(__byte_perm(hi4, 0x4B000000u, 0x7540 + e)) - 8388608.0f;
                const float lo = ds[r][0] * ql - dm[r][0];
                const float hi = ds[r][1] * qh - dm[r][1];
#pragma unroll
                for (int t = 0; t < TILE; t++) {
                    if (t < nt) {
                        float a, z;
                        if constexpr (V) {
                            a = e == 0 ? xl[t].x : e == 1 ? xl[t].y : e == 2 ? xl[t].z : xl[t].w;
                            z = e == 0 ? xh[t].x : e == 1 ? xh[t].y : e == 2 ? xh[t].z : xh[t].w;
                        } else {
                            a = x[t * ldx + lo_at + e];
                            z = x[t * ldx + hi_at + e];
                        }
                        acc[r * TILE + t] = fmaf(lo, a, acc[r * TILE + t]);
                        acc[r * TILE + t] = fmaf(hi, z, acc[r * TILE + t]);
                    }
                }
            }
        }
    }
}

// Q4_K's rows: this lane's super-blocks (one of each group of four) of R rows in order
// (acc as q4_k_lane32_dots'), V chosen from the pointers' alignment.
template <int TILE, int R = 1, bool XL = false>
__device__ __forceinline__ void q4_k_lane32_rows(const u8* const* w, int blocks,
                                                 const float* __restrict__ x, i64 ldx, int nt,
                                                 float* acc) {
    const int sub = (threadIdx.x & (WARP - 1)) >> 3;
    unsigned long long addr = (unsigned long long)x;
#pragma unroll
    for (int r = 0; r < R; r++) addr |= (unsigned long long)w[r];
    if (TILE <= 4 && (addr & 15) == 0 && (ldx & 3) == 0) {
#pragma unroll(TILE * R <= 4 ? 4 : 1)
        for (int g = 0; g < blocks; g += 4) {
            if (g + sub < blocks) {
                Q4kRaw raw[R];
#pragma unroll
                for (int r = 0; r < R; r++) q4_k_lane32_load<TILE <= 4>(w[r], g + sub, raw[r]);
                q4_k_lane32_dots<TILE, TILE <= 4, R, XL>(raw, g + sub, x, ldx, nt, acc);
            }
        }
    } else {
        for (int g = 0; g < blocks; g += 4) {
            if (g + sub < blocks) {
                Q4kRaw raw[R];
#pragma unroll
                for (int r = 0; r < R; r++) q4_k_lane32_load<false>(w[r], g + sub, raw[r]);
                q4_k_lane32_dots<TILE, false, R, XL>(raw, g + sub, x, ldx, nt, acc);
            }
        }
    }
}

// q4_k_lane32_rows' 16-byte path with each lane's header and quants streamed through a ring of
// S stages in shared memory (`ring`: S * R * 2 * THREADS 16-byte slots, THREADS the block's
// threads), so a warp has S passes of loads in flight instead of the registers' one. Each lane
// copies and reads back only its own slots (its copy groups complete for it at the wait; no
// barrier), and takes its super-blocks in q4_k_lane32_rows' order: the same bits. Only for
// TILE <= 4, 16-byte-aligned rows and x, and ldx a multiple of four (else q4_k_lane32_rows).
template <int TILE, int R, int S, int THREADS, bool XL = false>
__device__ __forceinline__ void q4_k_lane32_rows_async(const u8* const* w, int blocks,
                                                       const float* __restrict__ x, i64 ldx,
                                                       int nt, float* acc, uint4* ring) {
    const int lane = threadIdx.x & (WARP - 1), sub = lane >> 3;
    const int c = (lane & 7) >> 1, h = lane & 1;
    unsigned long long addr = (unsigned long long)x;
#pragma unroll
    for (int r = 0; r < R; r++) addr |= (unsigned long long)w[r];
    if (TILE > 4 || (addr & 15) != 0 || (ldx & 3) != 0) {
        q4_k_lane32_rows<TILE, R, XL>(w, blocks, x, ldx, nt, acc);
        return;
    }
    // Pass i is super-block 4 i + sub: its header (part 0) and this lane's quants (part 1).
    const int iters = sub < blocks ? (blocks - sub + 3) / 4 : 0;
    const u32 base = (u32)__cvta_generic_to_shared(ring) + 16u * threadIdx.x;
    auto slot = [&](int s, int r, int part) {
        return base + 16u * THREADS * (u32)((s * R + r) * 2 + part);
    };
    auto fetch = [&](int s, int i) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* blk = w[r] + (i64)(4 * i + sub) * 144;
            cp_async16(slot(s, r, 0), blk);
            cp_async16(slot(s, r, 1), blk + 16 + 32 * c + 16 * h);
        }
    };
#pragma unroll
    for (int s = 0; s < S; s++) {
        if (s < iters) fetch(s, s);
        cp_async_commit();
    }
    for (int i = 0; i < iters; i++) {
        cp_async_wait<S - 1>();
        const int s = i % S;
        Q4kRaw raw[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint4 hv = ld_shared16(slot(s, r, 0)), qv = ld_shared16(slot(s, r, 1));
            raw[r].head[0] = hv.x, raw[r].head[1] = hv.y, raw[r].head[2] = hv.z,
            raw[r].head[3] = hv.w;
            raw[r].q[0] = qv.x, raw[r].q[1] = qv.y, raw[r].q[2] = qv.z, raw[r].q[3] = qv.w;
        }
        q4_k_lane32_dots<TILE, true, R, XL>(raw, 4 * i + sub, x, ldx, nt, acc);
        // Stage s is read (its values are in registers): refill it with pass i + S.
        if (i + S < iters) fetch(s, i + S);
        cp_async_commit();
    }
    cp_async_wait<0>();
}

// Values 4 h .. 4 h + 3 of 16 bytes of a float-format row as f32 (a quarter of widen16's at a
// time; h < 1 for f32, < 2 for f16 and bf16).
template <int FMT>
__device__ __forceinline__ void widen4(const uint4 q, int h, float v[4]) {
    if (FMT == FMT_F32) {
        v[0] = __uint_as_float(q.x);
        v[1] = __uint_as_float(q.y);
        v[2] = __uint_as_float(q.z);
        v[3] = __uint_as_float(q.w);
    } else {
        const u32 words[2] = {h == 0 ? q.x : q.z, h == 0 ? q.y : q.w};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const u16 lo = (u16)(words[e] & 0xFFFF), hi = (u16)(words[e] >> 16);
            v[2 * e] = FMT == FMT_F16 ? f16_to_f32(lo) : bf16_to_f32(lo);
            v[2 * e + 1] = FMT == FMT_F16 ? f16_to_f32(hi) : bf16_to_f32(hi);
        }
    }
}

// The values of 16 bytes of a float-format row (4 for f32, 8 for f16 and bf16) as f32.
template <int FMT>
__device__ __forceinline__ void widen16(const uint4 q, float v[8]) {
    widen4<FMT>(q, 0, v);
    if (FMT != FMT_F32) widen4<FMT>(q, 1, v + 4);
}

// row_dots of a float-format row without 16-byte loads (a misaligned row or x, or cols not a
// multiple of 16 bytes' values): lane l takes values l, l + 32, ...
template <int FMT, int TILE>
__device__ __forceinline__ void float_row_dots_scalar(const u8* __restrict__ w, int cols,
                                                      const float* __restrict__ x, i64 ldx,
                                                      int nt, float* acc) {
    for (int i = threadIdx.x & (WARP - 1); i < cols; i += WARP) {
        const float v = FMT == FMT_F32   ? ((const float*)w)[i]
                        : FMT == FMT_F16 ? f16_to_f32(((const u16*)w)[i])
                                         : bf16_to_f32(((const u16*)w)[i]);
#pragma unroll
        for (int t = 0; t < TILE; t++)
            if (t < nt) acc[t] = fmaf(v, x[t * ldx + i], acc[t]);
    }
}

// One warp's partial dots of row `w` (format FMT, `cols` values) with `nt` <= TILE
// token rows of x (`x + t * ldx`), added into acc[t]. Lanes split the row in a fixed
// pattern, so results repeat bit for bit, whatever the TILE: each token's sum takes the same
// products in the same order (a smaller TILE only carries fewer accumulators, for decode's
// one to four tokens); the caller reduces across the warp.
template <int FMT, int TILE = TOK_TILE>
__device__ __forceinline__ void row_dots(const u8* __restrict__ w, int cols,
                                         const float* __restrict__ x, i64 ldx, int nt,
                                         float* acc) {
    const int lane = threadIdx.x & (WARP - 1);
    if (FMT == FMT_F32 || FMT == FMT_F16 || FMT == FMT_BF16) {
        // 16-byte loads where the row, x and the stride allow it (every cudaMalloc'd matrix
        // with cols a multiple of 8): a warp then reads 512 contiguous bytes of the row per
        // pass instead of 64 or 128, and two passes are in flight at once.
        const int per = FMT == FMT_F32 ? 4 : 8;  // values per 16 bytes
        const bool vec = (((unsigned long long)w | (unsigned long long)x) & 15) == 0 &&
                         (ldx & 3) == 0 && cols % per == 0;
        if (vec) {
            const uint4* wv = (const uint4*)w;
            const int nv = cols / per;
            // With few tokens, four passes' loads in flight a lane (2 KB a warp): a short
            // row's warp is otherwise latency-bound (the lm head's 154,880 rows of 8 KB).
#pragma unroll(TILE <= 4 ? 4 : 2)
            for (int j = lane; j < nv; j += WARP) {
                float v[8];
                widen16<FMT>(wv[j], v);
#pragma unroll
                for (int t = 0; t < TILE; t++) {
                    if (t < nt) {
                        const float4* xv = (const float4*)(x + t * ldx + (i64)j * per);
#pragma unroll
                        for (int h = 0; h < per / 4; h++) {
                            const float4 a = xv[h];
                            acc[t] = fmaf(v[4 * h], a.x, acc[t]);
                            acc[t] = fmaf(v[4 * h + 1], a.y, acc[t]);
                            acc[t] = fmaf(v[4 * h + 2], a.z, acc[t]);
                            acc[t] = fmaf(v[4 * h + 3], a.w, acc[t]);
                        }
                    }
                }
            }
        } else {
            float_row_dots_scalar<FMT, TILE>(w, cols, x, ldx, nt, acc);
        }
    } else if (FMT == FMT_Q8_0) {
        // Block b: f16 scale then 32 int8; lane l takes value l of every block. With few
        // tokens, four blocks' loads in flight a lane (as the float formats').
        const int blocks = cols / 32;
        if (TILE <= 4) {
#pragma unroll 4
            for (int b = 0; b < blocks; b++) q8_0_block_dots<TILE>(w, b, x, ldx, nt, acc);
        } else {
            for (int b = 0; b < blocks; b++) q8_0_block_dots<TILE>(w, b, x, ldx, nt, acc);
        }
    } else {
        // Q4_K: a lane's 32 values of one super-block of each group of four (q4_k_lane32_rows).
        const u8* const one[1] = {w};
        q4_k_lane32_rows<TILE>(one, cols / 256, x, ldx, nt, acc);
    }
}

// Calls CALL(FMT) with FMT a compile-time format constant chosen by the runtime `fmt`.
#define DISPATCH_FORMAT(fmt, CALL)            \
    switch (fmt) {                            \
        case FMT_F32: CALL(FMT_F32); break;   \
        case FMT_F16: CALL(FMT_F16); break;   \
        case FMT_BF16: CALL(FMT_BF16); break; \
        case FMT_Q8_0: CALL(FMT_Q8_0); break; \
        default: CALL(FMT_Q4_K); break;       \
    }

