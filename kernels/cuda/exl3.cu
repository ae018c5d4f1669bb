// EXL3 (exllamav3) linear layers straight from the trellis: y = x W with
// W = diag(suh) H What H diag(svh), H block-diagonal 128x128 orthonormal Hadamard. A product
// is three launches: `exl3_rotate_input` (xr = (x * suh) H), `exl3_gemv` (partial sums of
// xr What over slices of K, each tile decoded inside the dot) or `exl3_reconstruct` + cuBLAS
// for many tokens, then `exl3_rotate_output` (sum of the slices, H, * svh, + bias).
//
// The trellis is as the checkpoint stores it: int16 [K/16, N/16, 16 * bits], tile (kt, nt)
// at word (kt * N/16 + nt) * 8 * bits read as little-endian u32 words. Its bit stream reads
// each word from bit 31 down; position p owns the next d(p) bits (bits, or at half-integer
// rates floor(bits) on even and floor(bits) + 1 on odd p) and its 16-bit state is the 16
// stream bits ending where its own end, wrapping around the tile. Position p = 8 g + j sits
// at row 2 (g mod 4) + {0,1,8,9,0,1,8,9}[j], column g div 4 + {0,0,0,0,8,8,8,8}[j]: lane g
// of a warp decodes positions 8 g .. 8 g + 7, two columns of four rows.
//
// Arithmetic mirrors the CPU decoder (node-server/src/quant/exl3): the decoded weights are
// exllamav3's f16 values bit for bit, activations stay f32, the Hadamard butterfly runs in
// the same order with the same scale.
#include "common.cuh"

// Codebooks; the numbers match the Rust `Codebook` discriminants.
#define EXL3_INST3 0
#define EXL3_MCG 1
#define EXL3_MUL1 2

// 1 / sqrt(128) as the CPU rounds it.
#define EXL3_HSCALE 0.08838835f
// Warps of an `exl3_gemv` block: each takes every GEMV_WARPS-th tile of the block's slice.
#define EXL3_GEMV_WARPS 8
// Tiles a warp keeps in flight, and the words of a ring slot (a tile at 8 bpw: 4 x 16).
#define EXL3_RING 8
#define EXL3_RING_WORDS 64

__device__ __forceinline__ float round_f16(float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return f16_to_f32(h);
}

// The weight codebook CB gives 16-bit `state`. Every step is exact up to the one rounding
// to f16 that exllamav3 makes: mul1's value (1774 sum - 905216) / 2^18 is an f32 (the sum
// made a float exactly by the 2^23 trick, then one fma); 3inst's and mcg's two f16 halves
// add in f16, which rounds their exact sum once, as the f32 sum rounded to f16 does.
template <int CB>
__device__ __forceinline__ float exl3_value(u32 state) {
    if (CB == EXL3_MUL1) {
        const u32 y = state * 0x83DCD12Du;
        u32 sum;
        asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(sum) : "r"(y), "r"(0x01010101u), "r"(0u));
        const float s = __uint_as_float(0x4B000000u | sum) - 8388608.0f;
        return round_f16(fmaf(s, 1774.0f / 262144.0f, -905216.0f / 262144.0f));
    } else {
        u32 y = CB == EXL3_MCG ? state * 0xCBAC1FEDu : state * 89226354u + 64248484u;
        y = (y & 0x8FFF8FFFu) ^ 0x3B603B60u;
        u16 h;
        asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tadd.rn.f16 %0, lo, hi;\n\t}"
            : "=h"(h)
            : "r"(y));
        return f16_to_f32(h);
    }
}

// The top 32 bits of (hi:lo) << shift (shift < 32).
__device__ __forceinline__ u32 funnel_left(u32 lo, u32 hi, u32 shift) {
    u32 r;
    asm("shf.l.clamp.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(shift));
    return r;
}

// Where a lane's bits lie in a tile of rate H (4 H u32 words, H twice the bits per weight):
// the first of the four words holding the windows of its positions 8 lane .. 8 lane + 7, and
// the first window's bit offset in that word.
template <int H>
__device__ __forceinline__ void exl3_lane_window(int lane, int& w0, int& o) {
    constexpr int low = H >> 1, half = H & 1, bits = 128 * H;
    // The window of position 8 lane starts 16 bits before its end.
    const int end = (8 * lane + 1) * low + half * 4 * lane;
    const int start = (end - 16 + bits) % bits;
    w0 = start >> 5;
    o = start & 31;
}

// The tile's word indices holding a lane's bits: four from its first, wrapping around the
// tile's 4 H words (computed once per lane: the loads then need no wrap test).
template <int H>
__device__ __forceinline__ void exl3_lane_words(int w0, int idx[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) idx[i] = w0 + i >= 4 * H ? w0 + i - 4 * H : w0 + i;
}

// The lane's four words of the tile at `tile` (indices from `exl3_lane_words`).
__device__ __forceinline__ void exl3_load4(const u32* __restrict__ tile, const int idx[4],
                                           u32 a[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) a[i] = __ldg(tile + idx[i]);
}

// The lane's eight weights (positions 8 lane .. 8 lane + 7 in order) from its four words and
// first window offset `o`.
template <int H, int CB>
__device__ __forceinline__ void exl3_decode_words(const u32 a[4], int o, float w[8]) {
    constexpr int low = H >> 1, half = H & 1;
    // b[i]: the 32 bits from the first window's start + 32 i, so that every window below sits
    // at a compile-time offset (at most 7 * 8 + 4 bits; windows end by bit 76).
    u32 b[3];
#pragma unroll
    for (int i = 0; i < 3; i++) b[i] = funnel_left(a[i + 1], a[i], o);
    u32 state[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int d = j * low + half * ((j + 1) >> 1);
        state[j] = (d & 31) <= 16 ? (b[d >> 5] << (d & 31)) >> 16
                                  : funnel_left(b[(d >> 5) + 1], b[d >> 5], d & 31) >> 16;
    }
    if (CB == EXL3_MUL1) {
        // Two weights an f16x2 fma, exact as `exl3_value` is: the byte sum s < 1024 sits in
        // the f16 1024 + s (dp4a adds it to 0x6400), and (1024 + s) 1774/2^18 - 10.3828125
        // (both constants exact in f16) is the exact (1774 s - 905216) / 2^18, rounded to f16
        // once by the fma.
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            u32 lo, hi, h2;
            asm("dp4a.u32.u32 %0, %1, %2, %3;"
                : "=r"(lo) : "r"(state[j] * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
            asm("dp4a.u32.u32 %0, %1, %2, %3;"
                : "=r"(hi) : "r"(state[j + 1] * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
            asm("{\n\t.reg .b32 p;\n\tprmt.b32 p, %1, %2, 0x5410;\n\t"
                "fma.rn.f16x2 %0, p, %3, %4;\n\t}"
                : "=r"(h2) : "r"(lo), "r"(hi), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
            w[j] = f16_to_f32((u16)(h2 & 0xFFFFu));
            w[j + 1] = f16_to_f32((u16)(h2 >> 16));
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = exl3_value<CB>(state[j]);
    }
}

// The 128-wide Hadamard transform of the block's 128 values in `v` (shared; thread i wrote
// v[i]), scaled by 1/sqrt(128): thread i gets its value. The butterfly's order and the scale
// are the CPU's (node-server/src/quant/exl3/hadamard.rs), so results match it bit for bit.
__device__ __forceinline__ float exl3_hadamard128(float* v, int i) {
    __syncthreads();
    for (int h = 1; h < 128; h <<= 1) {
        const float a = v[i], b = v[i ^ h];
        __syncthreads();
        v[i] = (i & h) ? b - a : a + b;
        __syncthreads();
    }
    return v[i] * EXL3_HSCALE;
}

// xr[t, :] = (x[t, :] * suh) H for one 128-value block. Grid (K / 128, tokens), 128 threads.
extern "C" __global__ void exl3_rotate_input(const float* __restrict__ x,
                                             const float* __restrict__ suh, int k,
                                             float* __restrict__ xr) {
    __shared__ float v[128];
    const int i = threadIdx.x;
    const i64 at = (i64)blockIdx.y * k + blockIdx.x * 128 + i;
    v[i] = x[at] * suh[blockIdx.x * 128 + i];
    xr[at] = exl3_hadamard128(v, i);
}

// y[t, :] = (sum over s < splits of part[s, t, :]) H * svh + bias, for one 128-value block.
// Grid (N / 128, tokens), 128 threads. part is [splits, tokens, n].
extern "C" __global__ void exl3_rotate_output(const float* __restrict__ part, int splits,
                                              int tokens, int n, const float* __restrict__ svh,
                                              const float* __restrict__ bias, int has_bias,
                                              float* __restrict__ y) {
    __shared__ float v[128];
    const int i = threadIdx.x, c = blockIdx.x * 128 + i;
    const i64 at = (i64)blockIdx.y * n + c;
    float acc = 0.0f;
    for (int s = 0; s < splits; s++) acc += part[(i64)s * tokens * n + at];
    v[i] = acc;
    float out = exl3_hadamard128(v, i) * svh[c];
    if (has_bias) out += bias[c];
    y[at] = out;
}

// Copies 16 bytes from global to shared memory without passing through registers
// (sm_80+); completes at `exl3_cp_wait`. No memory clobbers: the callers order the ring's
// shared reads against the copies with __syncwarp, which the compiler does not move loads
// across.
__device__ __forceinline__ void exl3_cp16(u32* dst, const u32* src) {
    const u32 at = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(src));
}
__device__ __forceinline__ void exl3_cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most N of this thread's copy groups are still in flight.
template <int N>
__device__ __forceinline__ void exl3_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Issues the copy of tile `m` of the warp (at `src + m * step`, 16 H bytes: lanes 0 .. H - 1
// one 16-byte chunk each) into ring slot `m mod EXL3_RING`, and commits a group (empty past
// `count`, so that every lane's group count stays in step with m).
template <int H>
__device__ __forceinline__ void exl3_ring_fetch(u32 (*ring)[EXL3_RING_WORDS], const u32* src,
                                                i64 step, int m, int count, int lane) {
    if (m < count && lane < H) exl3_cp16(ring[m % EXL3_RING] + 4 * lane, src + m * step + 4 * lane);
    exl3_cp_commit();
}

// part[s * slice + t * N + 16 nt .. + 16] = xr[t, K slice s] What[K slice s, 16 nt .. 16 nt + 16]
// for every token t < tokens (xr rows K apart), TT tokens a pass. The block's strip nt is
// blockIdx.x and its slice s blockIdx.y; EXL3_GEMV_WARPS warps; slice s is k-tiles
// [s * per, (s + 1) * per). Every block writes its outputs, an empty slice zeros. `red` is the
// block's shared scratch and `ring` this warp's tile ring (declared by the kernel: one array
// for every instantiation). A token's sums take the same steps in the same order whatever TT
// and the other tokens are.
//
// Warp w takes the slice's tiles w, w + W, w + 2 W, ... in order. Its next EXL3_RING tiles are
// always in flight, copied global -> shared by cp.async: a tile is only 16 H bytes, so the
// bytes a GPU keeps in flight (what sets a GEMV's speed once HBM latency dominates) come from
// many tiles a warp, which registers could not hold.
template <int H, int CB, int TT>
__device__ void exl3_gemv_pass(const u32* __restrict__ trellis, int k, int n, int per,
                               const float* __restrict__ xr, int tokens, float* __restrict__ part,
                               i64 slice, float (*red)[TOK_TILE][16],
                               u32 (*ring)[EXL3_RING_WORDS]) {
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    const int nt = blockIdx.x, s = blockIdx.y;
    const int k_tiles = k / 16, n_tiles = n / 16, tile_words = 4 * H;
    const int kt0 = min(k_tiles, s * per), kt1 = min(k_tiles, kt0 + per);
    const int r0 = 2 * (lane & 3), c0 = lane >> 2;
    constexpr int W = EXL3_GEMV_WARPS;
    int w0, o, idx[4];
    exl3_lane_window<H>(lane, w0, o);
    exl3_lane_words<H>(w0, idx);
    const int first = kt0 + wid;
    const int count = first < kt1 ? (kt1 - first + W - 1) / W : 0;
    const i64 step = (i64)W * n_tiles * tile_words;
    const u32* src = trellis + ((i64)first * n_tiles + nt) * tile_words;
    for (int t0 = 0; t0 < tokens; t0 += TT) {
        const int nt_tok = min(TT, tokens - t0);
        float acc[TT][2];
#pragma unroll
        for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = 0.0f;
#pragma unroll
        for (int m = 0; m < EXL3_RING; m++) exl3_ring_fetch<H>(ring, src, step, m, count, lane);
        for (int m = 0; m < count; m++) {
            exl3_cp_wait<EXL3_RING - 1>();  // tile m has landed (this lane's part)
            __syncwarp();                     // ... and every lane's
            u32 a[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = ring[m % EXL3_RING][idx[i]];
            __syncwarp();  // all lanes have read the slot before it is refilled
            exl3_ring_fetch<H>(ring, src, step, m + EXL3_RING, count, lane);
            float w[8];
            exl3_decode_words<H, CB>(a, o, w);
            const float* xk = xr + (i64)t0 * k + 16 * (first + m * W) + r0;
#pragma unroll
            for (int t = 0; t < TT; t++) {
                if (TT == 1 || t < nt_tok) {
                    const float2 a2 = __ldg((const float2*)(xk + (i64)t * k));
                    const float2 b2 = __ldg((const float2*)(xk + (i64)t * k + 8));
                    float c = acc[t][0], d = acc[t][1];
                    c = fmaf(a2.x, w[0], c);
                    c = fmaf(a2.y, w[1], c);
                    c = fmaf(b2.x, w[2], c);
                    c = fmaf(b2.y, w[3], c);
                    d = fmaf(a2.x, w[4], d);
                    d = fmaf(a2.y, w[5], d);
                    d = fmaf(b2.x, w[6], d);
                    d = fmaf(b2.y, w[7], d);
                    acc[t][0] = c;
                    acc[t][1] = d;
                }
            }
        }
        // Lanes 4 c0 .. 4 c0 + 3 hold columns c0 and c0 + 8 of different rows.
#pragma unroll
        for (int t = 0; t < TT; t++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float v = acc[t][h];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if ((lane & 3) == 0) red[wid][t][c0 + 8 * h] = v;
            }
        }
        __syncthreads();
        if (threadIdx.x < TT * 16) {
            const int t = threadIdx.x / 16, c = threadIdx.x % 16;
            if (t < nt_tok) {
                float v = 0.0f;
                for (int i = 0; i < EXL3_GEMV_WARPS; i++) v += red[i][t][c];
                part[(i64)s * slice + (i64)(t0 + t) * n + 16 * nt + c] = v;
            }
        }
        __syncthreads();
    }
}

// The same sums for passes of more than one token: two tiles a step in registers, the next
// two loading meanwhile. Here each tile's x loads (TT rows) would wait behind the ring's warp
// barriers, so wider passes keep this loop; a token's sums add the tiles in the same order with
// the same steps as `exl3_gemv_pass`, so a pick's bits do not depend on the pass width.
template <int H, int CB, int TT>
__device__ void exl3_gemv_pass_pairs(const u32* __restrict__ trellis, int k, int n, int per,
                               const float* __restrict__ xr, int tokens, float* __restrict__ part,
                               i64 slice, float (*red)[TOK_TILE][16]) {
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    const int nt = blockIdx.x, s = blockIdx.y;
    const int k_tiles = k / 16, n_tiles = n / 16, tile_words = 4 * H;
    const int kt0 = min(k_tiles, s * per), kt1 = min(k_tiles, kt0 + per);
    const int r0 = 2 * (lane & 3), c0 = lane >> 2;
    int w0, o, idx[4];
    exl3_lane_window<H>(lane, w0, o);
    exl3_lane_words<H>(w0, idx);
    const u32* strip = trellis + (i64)nt * tile_words;
    const i64 stride = (i64)n_tiles * tile_words;
    for (int t0 = 0; t0 < tokens; t0 += TT) {
        const int nt_tok = min(TT, tokens - t0);
        float acc[TT][2];
#pragma unroll
        for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = 0.0f;
        // Two tiles a step (kt and kt + EXL3_GEMV_WARPS), the next step's words loading
        // while these decode; each token's sums still add the tiles in order.
        constexpr int W = EXL3_GEMV_WARPS;
        u32 cur[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (kt0 + wid + u * W < kt1) exl3_load4(strip + (kt0 + wid + u * W) * stride, idx, cur[u]);
        for (int kt = kt0 + wid; kt < kt1; kt += 2 * W) {
            u32 next[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (kt + (2 + u) * W < kt1)
                    exl3_load4(strip + (kt + (2 + u) * W) * stride, idx, next[u]);
            float w[2][8];
            exl3_decode_words<H, CB>(cur[0], o, w[0]);
            const bool second = kt + W < kt1;
            if (second) exl3_decode_words<H, CB>(cur[1], o, w[1]);
#pragma unroll
            for (int u = 0; u < 2; u++)
#pragma unroll
                for (int i = 0; i < 4; i++) cur[u][i] = next[u][i];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                if (u == 1 && !second) break;
                const float* xk = xr + (i64)t0 * k + 16 * (kt + u * W) + r0;
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    if (TT == 1 || t < nt_tok) {
                        const float2 a = __ldg((const float2*)(xk + (i64)t * k));
                        const float2 b = __ldg((const float2*)(xk + (i64)t * k + 8));
                        float c = acc[t][0], d = acc[t][1];
                        c = fmaf(a.x, w[u][0], c);
                        c = fmaf(a.y, w[u][1], c);
                        c = fmaf(b.x, w[u][2], c);
                        c = fmaf(b.y, w[u][3], c);
                        d = fmaf(a.x, w[u][4], d);
                        d = fmaf(a.y, w[u][5], d);
                        d = fmaf(b.x, w[u][6], d);
                        d = fmaf(b.y, w[u][7], d);
                        acc[t][0] = c;
                        acc[t][1] = d;
                    }
                }
            }
        }
        // Lanes 4 c0 .. 4 c0 + 3 hold columns c0 and c0 + 8 of different rows.
#pragma unroll
        for (int t = 0; t < TT; t++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float v = acc[t][h];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if ((lane & 3) == 0) red[wid][t][c0 + 8 * h] = v;
            }
        }
        __syncthreads();
        if (threadIdx.x < TT * 16) {
            const int t = threadIdx.x / 16, c = threadIdx.x % 16;
            if (t < nt_tok) {
                float v = 0.0f;
                for (int i = 0; i < EXL3_GEMV_WARPS; i++) v += red[i][t][c];
                part[(i64)s * slice + (i64)(t0 + t) * n + 16 * nt + c] = v;
            }
        }
        __syncthreads();
    }
}

// `exl3_gemv_pass` with the pass width for `tokens`: one (ONE; its own kernels, so that the
// lean one-token pass is not given the registers of the eight-token one), up to four, or eight.
template <int H, int CB, bool ONE>
__device__ void exl3_gemv_strip(const u32* __restrict__ trellis, int k, int n, int per,
                                const float* __restrict__ xr, int tokens, float* __restrict__ part,
                                i64 slice, float (*red)[TOK_TILE][16],
                                u32 (*ring)[EXL3_RING_WORDS]) {
    if (ONE)
        exl3_gemv_pass<H, CB, 1>(trellis, k, n, per, xr, tokens, part, slice, red, ring);
    else if (tokens <= 4)
        exl3_gemv_pass_pairs<H, CB, 4>(trellis, k, n, per, xr, tokens, part, slice, red);
    else
        exl3_gemv_pass_pairs<H, CB, TOK_TILE>(trellis, k, n, per, xr, tokens, part, slice, red);
}

// Calls CALL(H, CB) with compile-time rate and codebook; half-integer rates exist for mul1
// only (the host checks).
#define EXL3_DISPATCH_CB(H, cb, CALL)                  \
    switch (cb) {                                     \
        case EXL3_INST3: CALL(H, EXL3_INST3); break;  \
        case EXL3_MCG: CALL(H, EXL3_MCG); break;      \
        default: CALL(H, EXL3_MUL1); break;           \
    }
#define EXL3_DISPATCH(halves, cb, CALL)               \
    switch (halves) {                                 \
        case 2: EXL3_DISPATCH_CB(2, cb, CALL) break;  \
        case 3: CALL(3, EXL3_MUL1); break;            \
        case 4: EXL3_DISPATCH_CB(4, cb, CALL) break;  \
        case 5: CALL(5, EXL3_MUL1); break;            \
        case 6: EXL3_DISPATCH_CB(6, cb, CALL) break;  \
        case 7: CALL(7, EXL3_MUL1); break;            \
        case 8: EXL3_DISPATCH_CB(8, cb, CALL) break;  \
        case 10: EXL3_DISPATCH_CB(10, cb, CALL) break; \
        case 12: EXL3_DISPATCH_CB(12, cb, CALL) break; \
        case 14: EXL3_DISPATCH_CB(14, cb, CALL) break; \
        default: EXL3_DISPATCH_CB(16, cb, CALL) break; \
    }

// See `exl3_gemv_strip`. `halves` is twice the bits per weight (2..16). `exl3_gemv_one` takes
// one token row, `exl3_gemv` more.
template <bool ONE>
__device__ void exl3_gemv_kernel(const u32* __restrict__ trellis, int halves, int codebook, int k,
                                 int n, int per, const float* __restrict__ xr, int tokens,
                                 float* __restrict__ part) {
    __shared__ float red[EXL3_GEMV_WARPS][TOK_TILE][16];
    __shared__ __align__(16) u32 ring[EXL3_GEMV_WARPS][EXL3_RING][EXL3_RING_WORDS];
    u32(*mine)[EXL3_RING_WORDS] = ring[threadIdx.x / WARP];
#define CALL(H, CB)                                                                     \
    exl3_gemv_strip<H, CB, ONE>(trellis, k, n, per, xr, tokens, part, (i64)tokens * n, red, \
                                mine)
    EXL3_DISPATCH(halves, codebook, CALL)
#undef CALL
}

extern "C" __global__ void __launch_bounds__(256, 2) exl3_gemv(const u32* __restrict__ trellis, int halves, int codebook,
                                     int k, int n, int per, const float* __restrict__ xr,
                                     int tokens, float* __restrict__ part) {
    exl3_gemv_kernel<false>(trellis, halves, codebook, k, n, per, xr, tokens, part);
}

extern "C" __global__ void __launch_bounds__(256, 4) exl3_gemv_one(const u32* __restrict__ trellis, int halves,
                                         int codebook, int k, int n, int per,
                                         const float* __restrict__ xr, int tokens,
                                         float* __restrict__ part) {
    exl3_gemv_kernel<true>(trellis, halves, codebook, k, n, per, xr, tokens, part);
}

template <int H, int CB>
__device__ void exl3_reconstruct_tile(const u32* __restrict__ trellis, int n, int kt0, int kt1,
                                      float* __restrict__ out) {
    const int lane = threadIdx.x & (WARP - 1);
    const int n_tiles = n / 16;
    const i64 tile = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (tile >= (i64)(kt1 - kt0) * n_tiles) return;
    const int kt = kt0 + (int)(tile / n_tiles), nt = (int)(tile % n_tiles);
    int w0, o, idx[4];
    exl3_lane_window<H>(lane, w0, o);
    exl3_lane_words<H>(w0, idx);
    u32 a[4];
    exl3_load4(trellis + ((i64)kt * n_tiles + nt) * 4 * H, idx, a);
    float w[8];
    exl3_decode_words<H, CB>(a, o, w);
    const int r0 = 2 * (lane & 3), c0 = lane >> 2;
    float* dst = out + (i64)(16 * (kt - kt0) + r0) * n + 16 * nt + c0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int dr = (j & 1) + ((j & 2) ? 8 : 0), dc = (j & 4) ? 8 : 0;
        dst[(i64)dr * n + dc] = w[j];
    }
}

// out[(r - 16 kt0) * N + c] = What[r, c] for rows r of k-tiles kt0 .. kt1: the decoded
// weights in f32 (each an f16 value), for cuBLAS. A warp per tile.
extern "C" __global__ void exl3_reconstruct(const u32* __restrict__ trellis, int halves,
                                            int codebook, int n, int kt0, int kt1,
                                            float* __restrict__ out) {
#define CALL(H, CB) exl3_reconstruct_tile<H, CB>(trellis, n, kt0, kt1, out)
    EXL3_DISPATCH(halves, codebook, CALL)
#undef CALL
}

// ---- Routed experts whose slots hold EXL3 layers (see node-server/src/backend/cuda/moe.rs).
// A slot holds gate, up and down, each as its trellis, then suh and svh in f32, at byte
// offsets the host passes. A step's picks are listed group by group (a group: the picks of
// one slot); list entry i belongs to the slot at byte `entry_base[i]` of the arena. Products
// run in the rotated basis: the input rotation per entry (its slot's suh), a grouped GEMV per
// slot, then the output rotation per entry. Every entry's result depends only on its token
// row and its slot's bytes, never on which other picks share the launch.

// xr[z, i, :] = (x[row[i], :] * suh_z) H for entry i, z = 0 (gate) and 1 (up), suh_z at
// entry_base[i] + suh_off_z. Grid (entries, K / 128, 2), 128 threads.
extern "C" __global__ void exl3_moe_rotate_in(const u8* __restrict__ arena,
                                              const i64* __restrict__ entry_base,
                                              i64 suh_off0, i64 suh_off1,
                                              const int* __restrict__ row,
                                              const float* __restrict__ x, int k, int entries,
                                              float* __restrict__ xr) {
    __shared__ float v[128];
    const int i = threadIdx.x, e = blockIdx.x, z = blockIdx.z, c = blockIdx.y * 128 + i;
    const float* suh = (const float*)(arena + entry_base[e] + (z ? suh_off1 : suh_off0));
    v[i] = x[(i64)row[e] * k + c] * suh[c];
    xr[((i64)z * entries + e) * k + c] = exl3_hadamard128(v, i);
}

// The grouped GEMV over the groups `ids[0 .. *count)` (`cap` >= *count: the grid's room, as
// a table built on the device has no count the host knows): for group g = ids[blockIdx.z mod
// cap] and part z = blockIdx.z div cap, part[z, s, start_g + t, :] = xr[z, start_g + t, K slice s]
// What_z (t < len_g), What_z's trellis at group_base[g] + trellis_off_z. xr is [parts,
// entries, K], part [parts, splits, entries, N]. Grid (N / 16, splits, cap * parts),
// EXL3_GEMV_WARPS warps. `exl3_moe_gemv_one` takes groups of one pick, `exl3_moe_gemv` others.
template <bool ONE>
__device__ void exl3_moe_gemv_kernel(const u8* __restrict__ arena, int halves, int codebook,
                                     const i64* __restrict__ group_base,
                                     const int* __restrict__ group_start,
                                     const int* __restrict__ group_len,
                                     const int* __restrict__ ids,
                                     const int* __restrict__ count, int cap, i64 trellis_off0,
                                     i64 trellis_off1, int k, int n, int per,
                                     const float* __restrict__ xr, int entries,
                                     float* __restrict__ part) {
    __shared__ float red[EXL3_GEMV_WARPS][TOK_TILE][16];
    __shared__ __align__(16) u32 ring[EXL3_GEMV_WARPS][EXL3_RING][EXL3_RING_WORDS];
    const int gi = blockIdx.z % cap, z = blockIdx.z / cap;
    if (gi >= *count) return;  // a slot of a table built on the device that stayed empty
    const int g = ids[gi];
    const u32* trellis =
        (const u32*)(arena + group_base[g] + (z ? trellis_off1 : trellis_off0));
    const i64 slice = (i64)entries * n;
    const float* x = xr + ((i64)z * entries + group_start[g]) * k;
    float* out = part + (i64)z * gridDim.y * slice + (i64)group_start[g] * n;
    const int len = group_len[g];
#define CALL(H, CB) \
    exl3_gemv_strip<H, CB, ONE>(trellis, k, n, per, x, len, out, slice, red, ring[threadIdx.x / WARP])
    EXL3_DISPATCH(halves, codebook, CALL)
#undef CALL
}

#define EXL3_MOE_GEMV_ARGS                                                                     \
    const u8 *__restrict__ arena, int halves, int codebook, const i64 *__restrict__ group_base, \
        const int *__restrict__ group_start, const int *__restrict__ group_len,                \
        const int *__restrict__ ids, const int *__restrict__ count, int cap, i64 trellis_off0, \
        i64 trellis_off1, int k,                                                                \
        int n, int per, const float *__restrict__ xr, int entries, float *__restrict__ part
#define EXL3_MOE_GEMV_CALL                                                                     \
    arena, halves, codebook, group_base, group_start, group_len, ids, count, cap, trellis_off0, \
        trellis_off1, k, n, per, xr, entries, part

extern "C" __global__ void __launch_bounds__(256, 2) exl3_moe_gemv(EXL3_MOE_GEMV_ARGS) {
    exl3_moe_gemv_kernel<false>(EXL3_MOE_GEMV_CALL);
}

extern "C" __global__ void __launch_bounds__(256, 4) exl3_moe_gemv_one(EXL3_MOE_GEMV_ARGS) {
    exl3_moe_gemv_kernel<true>(EXL3_MOE_GEMV_CALL);
}

// The activation between the products, and the down product's input rotation: for entry i
// and 128-block c of inter, gate = (sum_s part[0, s, i]) H * svh_gate, up likewise from part
// 1, a = silu(min(gate, L)) * clamp(up, -L, L), and xd[i, block c] = (a * suh_down) H.
// Grid (entries, inter / 128), 128 threads.
extern "C" __global__ void exl3_moe_act(const u8* __restrict__ arena,
                                        const i64* __restrict__ entry_base, i64 svh_gate_off,
                                        i64 svh_up_off, i64 suh_down_off,
                                        const float* __restrict__ part, int splits, int entries,
                                        int inter, float limit, float* __restrict__ xd) {
    __shared__ float v[128];
    const int i = threadIdx.x, e = blockIdx.x, c = blockIdx.y * 128 + i;
    const u8* slot = arena + entry_base[e];
    const i64 slice = (i64)entries * inter;
    float sum[2];
#pragma unroll
    for (int z = 0; z < 2; z++) {
        float acc = 0.0f;
        for (int s = 0; s < splits; s++)
            acc += part[((i64)z * splits + s) * slice + (i64)e * inter + c];
        sum[z] = acc;
    }
    v[i] = sum[0];
    const float gate = exl3_hadamard128(v, i) * ((const float*)(slot + svh_gate_off))[c];
    __syncthreads();
    v[i] = sum[1];
    const float up = exl3_hadamard128(v, i) * ((const float*)(slot + svh_up_off))[c];
    const float a = silu(fminf(gate, limit)) * fminf(fmaxf(up, -limit), limit);
    __syncthreads();
    v[i] = a * ((const float*)(slot + suh_down_off))[c];
    xd[(i64)e * inter + c] = exl3_hadamard128(v, i);
}

// yp[pick[i], block c] = (sum_s part[s, i, block c]) H * svh_down for entry i. part is
// [splits, entries, N]. Grid (entries, N / 128), 128 threads.
extern "C" __global__ void exl3_moe_rotate_out(const u8* __restrict__ arena,
                                               const i64* __restrict__ entry_base, i64 svh_off,
                                               const float* __restrict__ part, int splits,
                                               int entries, int n, const int* __restrict__ pick,
                                               float* __restrict__ yp) {
    __shared__ float v[128];
    const int i = threadIdx.x, e = blockIdx.x, c = blockIdx.y * 128 + i;
    float acc = 0.0f;
    for (int s = 0; s < splits; s++) acc += part[((i64)s * entries + e) * n + c];
    v[i] = acc;
    const float* svh = (const float*)(arena + entry_base[e] + svh_off);
    yp[(i64)pick[e] * n + c] = exl3_hadamard128(v, i) * svh[c];
}
