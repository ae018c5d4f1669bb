// EXL3 (exllamav3) linear layers straight from the trellis: y = x W with
// W = diag(suh) H What H diag(svh), H block-diagonal 128x128 orthonormal Hadamard. A product
// is `exl3_rotate_input` (xr = (x * suh) H), then `exl3_gemv` (partial sums of xr What over
// slices of K, each tile decoded inside the dot; the last block of each 128 outputs adds the
// slices, H, * svh, + bias) or, for many tokens, `exl3_reconstruct` + cuBLAS and
// `exl3_rotate_output` (the same output rotation as a launch of its own).
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
// exllamav3's f16 values bit for bit, the Hadamard butterfly runs in the same order with the
// same scale. The GEMV multiplies on the tensor cores with each activation split into two
// f16 parts (22 of its 24 bits) and f32 accumulators; the cuBLAS path keeps f32.
#include "common.cuh"

// Codebooks; the numbers match the Rust `Codebook` discriminants.
#define EXL3_INST3 0
#define EXL3_MCG 1
#define EXL3_MUL1 2

// 1 / sqrt(128) as the CPU rounds it.
#define EXL3_HSCALE 0.08838835f
// Warps of an `exl3_gemv` block: each takes every GEMV_WARPS-th tile of the block's slice.
#define EXL3_GEMV_WARPS 8
// Outputs a GEMV block computes (a strip: two n-tiles, a pair), the pairs of tiles a warp
// keeps in flight, and the words of a ring slot: each tile of the pair (at 8 bpw 4 x 16 words)
// and its first four words again, so that a lane's four words never wrap around the tile.
#define EXL3_STRIP 32
#define EXL3_RING 4
#define EXL3_SLOT_WORDS 136
// Pairs a round of the GEMV's loop takes (EXL3_RING: every slot address a constant).
#ifndef EXL3_ROUND
#define EXL3_ROUND EXL3_RING
#endif
// GEMV blocks an SM keeps (the register budget: 4 gives 64 registers a thread).
#ifndef EXL3_GEMV_MIN_BLOCKS
#define EXL3_GEMV_MIN_BLOCKS 4
#endif

// Packs two f32 values as f16x2, each rounded to nearest: `first` in the low half.
__device__ __forceinline__ u32 pack_f16x2(float first, float second) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
    return r;
}

// The f16 weight 3inst or mcg (CB) gives 16-bit `state`: its two f16 halves add in f16, which
// rounds their exact sum once, as exllamav3's f32 sum rounded to f16 does.
template <int CB>
__device__ __forceinline__ u32 exl3_half(u32 state) {
    u32 y = CB == EXL3_MCG ? state * 0xCBAC1FEDu : state * 89226354u + 64248484u;
    y = (y & 0x8FFF8FFFu) ^ 0x3B603B60u;
    u16 h;
    asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tadd.rn.f16 %0, lo, hi;\n\t}"
        : "=h"(h)
        : "r"(y));
    return h;
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

// Words of its tile a lane's eight windows span at rate H from their first word: the last
// window ends 16 bits after position 7's start, which is at most 31 bits into the first word.
template <int H>
__device__ __forceinline__ constexpr int exl3_lane_span() {
    return ((7 * (H >> 1) + 4 * (H & 1) + 16 - 1 + 31) >> 5) + 1;
}

// The lane's four words of the tile at `tile` (indices from `exl3_lane_words`).
__device__ __forceinline__ void exl3_load4(const u32* __restrict__ tile, const int idx[4],
                                           u32 a[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) a[i] = __ldg(tile + idx[i]);
}

// The lane's eight weights (positions 8 lane .. 8 lane + 7 in order) from its four words and
// first window offset `o`, as f16 pairs: p[i] holds positions 8 lane + 2 i (low half) and
// 8 lane + 2 i + 1.
template <int H, int CB>
__device__ __forceinline__ void exl3_decode_pairs(const u32 a[4], int o, u32 p[4]) {
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
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        if (CB == EXL3_MUL1) {
            // Two weights an f16x2 fma, exact: the byte sum s < 1024 of (state 0x83DCD12D)
            // sits in the f16 1024 + s (dp4a adds it to 0x6400), and (1024 + s) 1774/2^18 -
            // 10.3828125 (both constants exact in f16) is exllamav3's (1774 s - 905216) /
            // 2^18, rounded to f16 once by the fma.
            u32 lo, hi, h2;
            asm("dp4a.u32.u32 %0, %1, %2, %3;"
                : "=r"(lo) : "r"(state[j] * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
            asm("dp4a.u32.u32 %0, %1, %2, %3;"
                : "=r"(hi) : "r"(state[j + 1] * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
            asm("{\n\t.reg .b32 p;\n\tprmt.b32 p, %1, %2, 0x5410;\n\t"
                "fma.rn.f16x2 %0, p, %3, %4;\n\t}"
                : "=r"(h2) : "r"(lo), "r"(hi), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
            p[j / 2] = h2;
        } else {
            p[j / 2] = exl3_half<CB>(state[j]) | (exl3_half<CB>(state[j + 1]) << 16);
        }
    }
}

// The same eight weights widened to f32, in position order.
template <int H, int CB>
__device__ __forceinline__ void exl3_decode_words(const u32 a[4], int o, float w[8]) {
    u32 p[4];
    exl3_decode_pairs<H, CB>(a, o, p);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[2 * i] = f16_to_f32((u16)(p[i] & 0xFFFFu));
        w[2 * i + 1] = f16_to_f32((u16)(p[i] >> 16));
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

// The GEMV's activations go to the tensor cores as f16: each value x, times EXL3_XSCALE, as
// hi = f16(x) and lo = f16((x - hi) 2^11), so hi + lo 2^-11 keeps 22 of x's 24 bits. With
// the scale, |x| up to 2^20 fits f16's range, and values below 2^-10 lose bits only against
// an absolute 2^-31 (negligible next to the O(1) values around them).
#define EXL3_XSCALE 0.0625f
#define EXL3_XUNSCALE 16.0f
#define EXL3_LO_SCALE 2048.0f
#define EXL3_LO_UNSCALE 0.00048828125f

// Stores a Hadamard block's 128 values (thread i's `val`; v the block's shared scratch) as
// the GEMV reads them: each 16-value k-tile as 16 words, words 4 q .. 4 q + 3 being hi of
// values (2 q, 2 q + 1), hi of (2 q + 8, 2 q + 9), then lo of the same two pairs, each pair
// as f16x2 (first value in the low half) — what lane q of an mma's B column reads, in one
// 16-byte load. Thread i writes word i of the block (`dst`: where its f32 values would be).
// Word i of a Hadamard block's split form from its 128 scaled values v (shared).
__device__ __forceinline__ u32 exl3_split_word(const float* v, int i) {
    const int q = (i >> 2) & 3, kind = i & 3;
    const int at = (i & ~15) + 2 * q + ((kind & 1) << 3);
    const float a = v[at], b = v[at + 1];
    u32 h = pack_f16x2(a, b);
    if (kind & 2)
        h = pack_f16x2((a - f16_to_f32((u16)(h & 0xFFFFu))) * EXL3_LO_SCALE,
                       (b - f16_to_f32((u16)(h >> 16))) * EXL3_LO_SCALE);
    return h;
}

__device__ __forceinline__ void exl3_store_split(float* v, int i, float val,
                                                 u32* __restrict__ dst) {
    __syncthreads();
    v[i] = val * EXL3_XSCALE;
    __syncthreads();
    dst[i] = exl3_split_word(v, i);
}

// A rotated value `val` of block `blk` of row `row` (K values a row) into xr: f32, or in the
// GEMV's split form when `split`.
__device__ __forceinline__ void exl3_store_rotated(float* v, int i, float val, float* xr,
                                                   i64 at, int split) {
    if (split)
        exl3_store_split(v, i, val, (u32*)xr + (at - i));
    else
        xr[at] = val;
}

// The GEMM's form of a rotated value (`split` 2): the hi and lo halves the GEMV's split form
// holds (val times EXL3_XSCALE), in two f16 planes of `plane` values each, [tokens, K] like
// xr's f32 values: hi at `at` of the first plane, lo at `at` of the second.
__device__ __forceinline__ void exl3_store_planes(float val, u16* __restrict__ planes, i64 at,
                                                  i64 plane) {
    const float x = val * EXL3_XSCALE;
    const u32 h = pack_f16x2(x, 0.0f);
    planes[at] = (u16)h;
    planes[plane + at] = (u16)pack_f16x2((x - f16_to_f32((u16)h)) * EXL3_LO_SCALE, 0.0f);
}

// xr[t, :] = (x[t, :] * suh) H for one 128-value block: f32 (`split` 0), the GEMV's split
// form (1), or the GEMM's two f16 planes (2; xr then holds 2 x tokens x K halves).
// Grid (K / 128, tokens), 128 threads.
extern "C" __global__ void exl3_rotate_input(const float* __restrict__ x,
                                             const float* __restrict__ suh, int k, int split,
                                             float* __restrict__ xr) {
    grid_wait();
    __shared__ float v[128];
    const int i = threadIdx.x;
    const i64 at = (i64)blockIdx.y * k + blockIdx.x * 128 + i;
    v[i] = x[at] * suh[blockIdx.x * 128 + i];
    const float val = exl3_hadamard128(v, i);
    if (split == 2)
        exl3_store_planes(val, (u16*)xr, at, (i64)gridDim.y * k);
    else
        exl3_store_rotated(v, i, val, xr, at, split);
}

// y[t, :] = (sum over s < splits of part[s, t, :]) H * svh + bias, for one 128-value block.
// Grid (N / 128, tokens), 128 threads. part is [splits, tokens, n].
extern "C" __global__ void exl3_rotate_output(const float* __restrict__ part, int splits,
                                              int tokens, int n, const float* __restrict__ svh,
                                              const float* __restrict__ bias, int has_bias,
                                              float* __restrict__ y) {
    grid_wait();
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

// Copies 16 bytes from global memory to the shared-space address `at` without passing
// through registers (sm_80+); completes at `exl3_cp_wait`. No memory clobbers: the ring's
// shared reads (`exl3_lds`, volatile too) are ordered against the copies by __syncwarp.
__device__ __forceinline__ void exl3_cp16_at(u32 at, const u32* src) {
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

// The word at shared-space address `at`; volatile, so it stays between the __syncwarp calls
// that order it against the copies.
__device__ __forceinline__ u32 exl3_lds(u32 at) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(at));
    return v;
}

// D += A B on the tensor cores (mma m16n8k16, f16 inputs, f32 accumulators): A a 16 x 16
// tile of f16 weights as four f16x2 registers, B a 16 x 8 block of f16 activations as two.
__device__ __forceinline__ void exl3_mma(float d[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A slice's input rotation inside a GEMV block (`exl3_gemv_pass` with ROT): for tokens t0 ..
// t0 + ntok - 1 and k-tiles kt0 .. kt1 (multiples of 8), xsh[c * stride + i] = word i of the
// slice in the split form, of xr[t0 + c] = (x[t0 + c] * suh) H — what `exl3_rotate_input`
// writes, bit for bit: a warp takes one (token, Hadamard block) at a time, four values a lane,
// and runs the same butterfly with shuffles (pair (i, i ^ h) becomes (a + b, a - b) as in
// `exl3_hadamard128`). `scratch`: this warp's 128 floats. Ends with the block synced.
__device__ void exl3_rotate_slice(const float* __restrict__ x, const float* __restrict__ suh, int k,
                                  int kt0, int kt1, int t0, int ntok, int stride,
                                  float* scratch, u32* xsh) {
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    const int blocks = (kt1 - kt0) / 8;
    for (int pr = wid; pr < ntok * blocks; pr += EXL3_GEMV_WARPS) {
        const int c = pr / blocks, b = pr % blocks;
        const int col = kt0 * 16 + b * 128 + 4 * lane;
        const float* xt = x + (i64)(t0 + c) * k;
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = __fmul_rn(xt[col + j], suh[col + j]);  // never fused
#pragma unroll
        for (int h = 1; h < 4; h <<= 1)
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (!(j & h)) {
                    const float a = v[j], bb = v[j + h];
                    v[j] = a + bb;
                    v[j + h] = a - bb;
                }
#pragma unroll
        for (int h = 1; h < 32; h <<= 1) {
            const bool upper = lane & h;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float other = __shfl_xor_sync(0xffffffffu, v[j], h);
                v[j] = upper ? other - v[j] : v[j] + other;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) scratch[4 * lane + j] = (v[j] * EXL3_HSCALE) * EXL3_XSCALE;
        __syncwarp();
        u32* dst = xsh + (i64)c * stride + b * 128;
#pragma unroll
        for (int j = 0; j < 4; j++) dst[4 * lane + j] = exl3_split_word(scratch, 4 * lane + j);
        __syncwarp();
    }
    __syncthreads();
}

// part[s * slice + t * N + 32 st .. + 32] = xr[t, K slice s] What[K slice s, 32 st .. 32 st + 32]
// for every token t < tokens (xr in the split form of `exl3_store_split`, rows K words
// apart), TOK_TILE tokens a pass. The block's strip st (32 outputs: n-tiles 2 st and 2 st + 1,
// a pair that lies contiguous in the trellis) is blockIdx.x and its slice s blockIdx.y;
// EXL3_GEMV_WARPS warps; slice s is k-tiles [s * per, (s + 1) * per). Every block writes its
// outputs, an empty slice zeros. `rings` are the block's warps' pair rings (declared by the
// kernel: one array for every instantiation), also the reduction's scratch after the loop;
// `scratch` (with ROT) the input rotation's 128 floats a warp.
//
// Warp w takes the slice's k-tiles w, w + W, w + 2 W, ... in order, each as its pair of
// tiles, which share the k-tile's activations. Its next EXL3_RING pairs are always in flight,
// copied global -> shared by cp.async (one instruction a pair): a tile is only 16 H bytes, so
// the bytes a GPU keeps in flight (what sets a GEMV's speed once HBM latency dominates) come
// from many tiles a warp, which registers could not hold. The loop is unrolled over the ring,
// so that every slot's shared address is a constant.
//
// The products run on the tensor cores: a lane's eight decoded weights are by the format's
// design its part of the mma's A (the tile transposed: output columns are A's rows), the
// pass's tokens are B's columns (lane 4 c + q holds token c's values 2 q, 2 q + 1, 2 q + 8,
// 2 q + 9), hi and lo parts in two accumulators of their own. A column of B never meets
// another in an mma, so a token's sums take the same steps in the same order whatever the
// other tokens of its pass are; and a column's sums do not depend on the other tile of its pair.
//
// With ROT the block rotates its own slice of the input first: `xs` is then unread and x (f32
// rows of K) and suh give the slice, which each pass writes in the split form to `xsh` (the
// block's dynamic shared memory, per * 16 words a token) while its first tiles are in flight.
// The slice must start at a multiple of 8 k-tiles (a Hadamard block; the host makes per one).
template <int H, int CB, bool ROT, int SW = 1>
__device__ void exl3_gemv_pass(const u32* __restrict__ trellis, int k, int n, int per,
                               const u32* __restrict__ xs, int tokens, float* __restrict__ part,
                               i64 slice, u32 (*rings)[EXL3_RING][EXL3_SLOT_WORDS],
                               float* scratch, const float* __restrict__ x,
                               const float* __restrict__ suh, u32* xsh) {
    static_assert(!ROT || SW == 1, "a block rotates one pass's tokens at a time");
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    const int st = blockIdx.x, s = blockIdx.y;
    const int k_tiles = k / 16, n_tiles = n / 16;
    constexpr int tile_words = 4 * H, half_slot = 4 * H + 4;
    const int kt0 = min(k_tiles, s * per), kt1 = min(k_tiles, kt0 + per);
    const int q = lane & 3, c0 = lane >> 2;
    constexpr int W = EXL3_GEMV_WARPS;
    u32(*ring)[EXL3_SLOT_WORDS] = rings[wid];
    // The reduction's scratch, after the loop: each warp's TOK_TILE x 32 sums in its own ring
    // (no copy is in flight then), read across the warps as red(i)[t * 32 + c].
    auto red = [&](int i) { return (float*)&rings[i][0][0]; };
    static_assert(TOK_TILE * EXL3_STRIP <= EXL3_RING * EXL3_SLOT_WORDS, "sums fit a warp's ring");
    int w0, o;
    exl3_lane_window<H>(lane, w0, o);
    const int first = kt0 + wid;
    const int count = first < kt1 ? (kt1 - first + W - 1) / W : 0;
    const i64 step = (i64)W * n_tiles * tile_words;
    // The warp's first pair.
    const u32* src = trellis + ((i64)first * n_tiles + 2 * st) * tile_words;
    // A pair's slot: each tile's 4 H words, then its first 4 words again (so that a lane's
    // words never wrap around the tile), 2 (H + 1) chunks of 16 bytes. Chunk L is copied by
    // lane L (and L - 32 where there are more than 32: 8 bpw).
    constexpr int chunks = 2 * (H + 1);
    constexpr int rounds = (chunks + WARP - 1) / WARP;
    int from[rounds];
    u32 to[rounds];
#pragma unroll
    for (int r = 0; r < rounds; r++) {
        const int l = lane + WARP * r, t = l / (H + 1), c = l % (H + 1);
        from[r] = t * tile_words + (c == H ? 0 : 4 * c);
        to[r] = 4 * (t * half_slot + 4 * c);
    }
    // Shared-space addresses in ring slot 0: where this lane's chunks land, and its first word.
    const u32 slot0 = (u32)__cvta_generic_to_shared(ring[0]);
    const u32 get = slot0 + 4 * w0;
    constexpr u32 slot_bytes = 4 * EXL3_SLOT_WORDS;
    constexpr int span = exl3_lane_span<H>();
    float* dst = part + (i64)s * slice + EXL3_STRIP * st;
    // Copies the pair whose chunks this lane reads at `at` into the slot at `slot`.
    auto copy_pair = [&](u32 slot, const u32* const at[rounds]) {
#pragma unroll
        for (int r = 0; r < rounds; r++)
            if (lane + WARP * r < chunks) exl3_cp16_at(slot + to[r], at[r]);
    };
    // A sweep takes SW passes of TOK_TILE tokens through the slice together: each tile is
    // copied and decoded once for all of them, and each pass keeps accumulators of its own,
    // which see the same products in the same order as a sweep of one pass would give them.
    for (int t0 = 0; t0 < tokens; t0 += SW * TOK_TILE) {
        const int passes = SW == 1 ? 1 : min(SW, (tokens - t0 + TOK_TILE - 1) / TOK_TILE);
        // This lane's B column of pass pp is token t0 + TOK_TILE pp + c0: its 4 words of each
        // k-tile, W k-tiles a step. A column past the pass's tokens reads the pass's first
        // token's words: its sums are never stored, and a column of B never meets another.
        const uint4* xq[SW];
#pragma unroll
        for (int pp = 0; pp < SW; pp++) {
            const int tp = t0 + TOK_TILE * min(pp, passes - 1);
            const int row = c0 < min(TOK_TILE, tokens - tp) ? c0 : 0;
            xq[pp] = ROT ? (const uint4*)(xsh + (i64)row * per * 16) + 4 * (first - kt0) + q
                         : (const uint4*)(xs + (i64)(tp + row) * k) + 4 * first + q;
        }
        float hi[SW][2][4], lo[SW][2][4];
#pragma unroll
        for (int pp = 0; pp < SW; pp++)
#pragma unroll
            for (int j = 0; j < 8; j++) hi[pp][j >> 2][j & 3] = lo[pp][j >> 2][j & 3] = 0.0f;
        // This lane's chunks of the next pair to copy.
        const u32* next[rounds];
#pragma unroll
        for (int r = 0; r < rounds; r++) next[r] = src + from[r];
#pragma unroll
        for (int m = 0; m < EXL3_RING; m++) {
            if (m < count) copy_pair(slot0 + m * slot_bytes, next);
            exl3_cp_commit();
#pragma unroll
            for (int r = 0; r < rounds; r++) next[r] += step;
        }
        if (ROT)
            exl3_rotate_slice(x, suh, k, kt0, kt1, t0, min(TOK_TILE, tokens - t0), per * 16,
                              scratch + 128 * wid, xsh);
        // Pairs a round of the loop takes, each slot's address a constant (at 8 bpw one: the
        // unrolled round would not fit the register budget).
        constexpr int round = H == 16 ? 1 : EXL3_ROUND;
        for (int m0 = 0; m0 < count; m0 += round) {
#pragma unroll
            for (int uu = 0; uu < round; uu++) {
                const int m = m0 + uu, u = round == EXL3_RING ? uu : m % EXL3_RING;
                if (m >= count) break;
                uint4 xv[SW];
#pragma unroll
                for (int pp = 0; pp < SW; pp++)
                    if (pp < passes) xv[pp] = ROT ? xq[pp][4 * W * uu] : __ldg(xq[pp] + 4 * W * uu);
                exl3_cp_wait<EXL3_RING - 1>();  // pair m has landed (this lane's part)
                __syncwarp();                    // ... and every lane's
                // Each tile's words are read just before its decode (fewer live registers).
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    u32 a[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                    for (int i = 0; i < span; i++)
                        a[i] = exl3_lds(get + u * slot_bytes + 4 * (t * half_slot + i));
                    u32 p[4];
                    exl3_decode_pairs<H, CB>(a, o, p);
                    // A: (row c0, k 2q..), (row c0 + 8, k 2q..), (row c0, k 2q + 8..),
                    // (c0 + 8, 2q + 8..).
                    const u32 frag[4] = {p[0], p[2], p[1], p[3]};
#pragma unroll
                    for (int pp = 0; pp < SW; pp++)
                        if (pp < passes) {
                            exl3_mma(hi[pp][t], frag, xv[pp].x, xv[pp].y);
                            exl3_mma(lo[pp][t], frag, xv[pp].z, xv[pp].w);
                        }
                }
                __syncwarp();  // all lanes have read the slot before it is refilled
                // Pair m + EXL3_RING into the slot just read (an empty group past the last
                // pair, so that every lane's group count stays in step with m).
                if (m + EXL3_RING < count) copy_pair(slot0 + u * slot_bytes, next);
                exl3_cp_commit();
#pragma unroll
                for (int r = 0; r < rounds; r++) next[r] += step;
            }
#pragma unroll
            for (int pp = 0; pp < SW; pp++) xq[pp] += 4 * W * round;
        }
#pragma unroll
        for (int pp = 0; pp < SW; pp++) {
            if (pp >= passes) break;
            const int tp = t0 + TOK_TILE * pp, nt_tok = min(TOK_TILE, tokens - tp);
            // Lane 4 c0 + q holds columns c0 and c0 + 8 of each tile, tokens 2 q and 2 q + 1.
#pragma unroll
            for (int j = 0; j < 8; j++)
                red(wid)[EXL3_STRIP * (2 * q + (j & 1)) + 16 * (j >> 2) + c0 + 8 * ((j >> 1) & 1)] =
                    fmaf(lo[pp][j >> 2][j & 3], EXL3_LO_UNSCALE, hi[pp][j >> 2][j & 3]);
            __syncthreads();
            if (threadIdx.x < TOK_TILE * EXL3_STRIP) {
                const int t = threadIdx.x / EXL3_STRIP, c = threadIdx.x % EXL3_STRIP;
                if (t < nt_tok) {
                    float v = 0.0f;
                    for (int i = 0; i < EXL3_GEMV_WARPS; i++) v += red(i)[EXL3_STRIP * t + c];
                    dst[(i64)(tp + t) * n + c] = v * EXL3_XUNSCALE;
                }
            }
            __syncthreads();
        }
    }
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

// `exl3_rotate_output` for the 128 outputs of block g of every token, by one block of
// 2 x 128 threads (two tokens at a time): the same sums in the same order, so the same bits.
__device__ void exl3_finish_block(const float* __restrict__ part, int splits, int tokens,
                                  int n, int g, const float* __restrict__ svh,
                                  const float* __restrict__ bias, int has_bias,
                                  float* __restrict__ y) {
    __shared__ float v[2][128];
    const int half = threadIdx.x >> 7, i = threadIdx.x & 127, c = g * 128 + i;
    for (int t0 = 0; t0 < tokens; t0 += 2) {
        const int t = t0 + half;
        float acc = 0.0f;
        if (t < tokens)
            for (int s = 0; s < splits; s++) acc += __ldcg(part + ((i64)s * tokens + t) * n + c);
        v[half][i] = acc;
        float out = exl3_hadamard128(v[half], i) * svh[c];
        if (has_bias) out += bias[c];
        if (t < tokens) y[(i64)t * n + c] = out;
    }
}

// A whole product's GEMV and output rotation: `exl3_gemv_pass` writes the block's partial
// sums to part ([splits, tokens, N]); the last of the 4 strips x splits blocks of each 128
// outputs to finish (tickets[st / 4], left at zero) adds the slices in order, rotates and
// scales them into y ([tokens, N]) as `exl3_rotate_output` does. `halves` is twice the bits
// per weight (2..16); xs as `exl3_rotate_input` writes it with `split`, or with `rotate` each
// block rotates its slice of x itself (per a multiple of 8; dynamic shared memory of
// min(tokens, TOK_TILE) * per * 16 words). 256 threads.
extern "C" __global__ void __launch_bounds__(256, EXL3_GEMV_MIN_BLOCKS) exl3_gemv(
    const u32* __restrict__ trellis, int halves, int codebook, int k, int n, int per,
    const u32* __restrict__ xs, int tokens, float* __restrict__ part,
    const float* __restrict__ svh, const float* __restrict__ bias, int has_bias,
    u32* __restrict__ tickets, float* __restrict__ y, const float* __restrict__ x,
    const float* __restrict__ suh, int rotate) {
    grid_wait();
    __shared__ __align__(16) u32 ring[EXL3_GEMV_WARPS][EXL3_RING][EXL3_SLOT_WORDS];
    __shared__ float scratch[EXL3_GEMV_WARPS * 128];  // the input rotation's, a warp's 128
    extern __shared__ __align__(16) u32 xsh[];
#define CALL(H, CB)                                                                          \
    if (rotate)                                                                              \
        exl3_gemv_pass<H, CB, true>(trellis, k, n, per, xs, tokens, part, (i64)tokens * n,    \
                                    ring, scratch, x, suh, xsh);                             \
    else                                                                                     \
        exl3_gemv_pass<H, CB, false>(trellis, k, n, per, xs, tokens, part, (i64)tokens * n,   \
                                     ring, scratch, x, suh, xsh);
    EXL3_DISPATCH(halves, codebook, CALL)
#undef CALL
    constexpr int strips = 128 / EXL3_STRIP;  // strips of a ticket's 128 outputs
    if (last_of_group(tickets + blockIdx.x / strips, strips * gridDim.y))
        exl3_finish_block(part, gridDim.y, tokens, n, blockIdx.x / strips, svh, bias, has_bias, y);
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

// The same tile's values as the f16 bits the decode makes, for cuBLAS's f16 GEMM.
template <int H, int CB>
__device__ void exl3_reconstruct_tile_f16(const u32* __restrict__ trellis, int n, int kt0,
                                          int kt1, u16* __restrict__ out) {
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
    u32 p[4];
    exl3_decode_pairs<H, CB>(a, o, p);
    const int r0 = 2 * (lane & 3), c0 = lane >> 2;
    u16* dst = out + (i64)(16 * (kt - kt0) + r0) * n + 16 * nt + c0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int dr = (j & 1) + ((j & 2) ? 8 : 0), dc = (j & 4) ? 8 : 0;
        dst[(i64)dr * n + dc] = (u16)(p[j >> 1] >> (16 * (j & 1)));
    }
}

// out[(r - 16 kt0) * N + c] = What[r, c] for rows r of k-tiles kt0 .. kt1: the decoded
// weights in f32 (each an f16 value), or as f16 bits with `half` (out then holds halves),
// for cuBLAS. A warp per tile.
extern "C" __global__ void exl3_reconstruct(const u32* __restrict__ trellis, int halves,
                                            int codebook, int n, int kt0, int kt1, int half,
                                            float* __restrict__ out) {
    grid_wait();
#define CALL(H, CB)                                                                    \
    if (half)                                                                          \
        exl3_reconstruct_tile_f16<H, CB>(trellis, n, kt0, kt1, (u16*)out);             \
    else                                                                               \
        exl3_reconstruct_tile<H, CB>(trellis, n, kt0, kt1, out)
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
// entry_base[i] + suh_off_z, in the GEMV's split form. Grid (entries, K / 128, 2), 128 threads.
extern "C" __global__ void exl3_moe_rotate_in(const u8* __restrict__ arena,
                                              const i64* __restrict__ entry_base,
                                              i64 suh_off0, i64 suh_off1,
                                              const int* __restrict__ row,
                                              const float* __restrict__ x, int k, int entries,
                                              float* __restrict__ xr) {
    grid_wait();
    __shared__ float v[128];
    const int i = threadIdx.x, e = blockIdx.x, z = blockIdx.z, c = blockIdx.y * 128 + i;
    const float* suh = (const float*)(arena + entry_base[e] + (z ? suh_off1 : suh_off0));
    v[i] = x[(i64)row[e] * k + c] * suh[c];
    exl3_store_split(v, i, exl3_hadamard128(v, i), (u32*)xr + ((i64)z * entries + e) * k + c - i);
}

// Token passes of a sweep of `exl3_moe_gemv_wide` (each tile decoded once for 8 SW tokens).
#define EXL3_WIDE_SWEEP 4

// The grouped GEMV over groups 0 .. *count (`cap` >= *count: the grid's room, as a table
// built on the device has no count the host knows): for group g = blockIdx.z mod cap and part
// z = blockIdx.z div cap, part[z, s, start_g + t, :] = xr[z, start_g + t, K slice s] What_z
// (t < len_g), What_z's trellis at group_base[g] + trellis_off_z. xr is [parts, entries, K] in
// the split form, part [parts, splits, entries, N]. Grid (N / 32, splits, cap * parts),
// EXL3_GEMV_WARPS warps. SW token passes a sweep.
template <int SW>
__device__ void exl3_moe_gemv_body(const u8* __restrict__ arena, int halves, int codebook,
                                   const i64* __restrict__ group_base,
                                   const int* __restrict__ group_start,
                                   const int* __restrict__ group_len,
                                   const int* __restrict__ count, int cap, i64 trellis_off0,
                                   i64 trellis_off1, int k, int n, int per,
                                   const u32* __restrict__ xr, int entries,
                                   float* __restrict__ part) {
    __shared__ __align__(16) u32 ring[EXL3_GEMV_WARPS][EXL3_RING][EXL3_SLOT_WORDS];
    const int g = blockIdx.z % cap, z = blockIdx.z / cap;
    if (g >= *count) return;  // room of a table built on the device that stayed empty
    const u32* trellis =
        (const u32*)(arena + group_base[g] + (z ? trellis_off1 : trellis_off0));
    const i64 slice = (i64)entries * n;
    const u32* x = xr + ((i64)z * entries + group_start[g]) * k;
    float* out = part + (i64)z * gridDim.y * slice + (i64)group_start[g] * n;
    const int len = group_len[g];
#define CALL(H, CB)                                                                     \
    exl3_gemv_pass<H, CB, false, SW>(trellis, k, n, per, x, len, out, slice, ring, nullptr, \
                                     nullptr, nullptr, nullptr)
    EXL3_DISPATCH(halves, codebook, CALL)
#undef CALL
}

extern "C" __global__ void __launch_bounds__(256, EXL3_GEMV_MIN_BLOCKS) exl3_moe_gemv(
    const u8* __restrict__ arena, int halves, int codebook, const i64* __restrict__ group_base,
    const int* __restrict__ group_start, const int* __restrict__ group_len,
    const int* __restrict__ count, int cap, i64 trellis_off0,
    i64 trellis_off1, int k, int n, int per, const u32* __restrict__ xr, int entries,
    float* __restrict__ part) {
    grid_wait();
    exl3_moe_gemv_body<1>(arena, halves, codebook, group_base, group_start, group_len, count,
                          cap, trellis_off0, trellis_off1, k, n, per, xr, entries, part);
}

// `exl3_moe_gemv` for groups of many picks (prompt chunks): EXL3_WIDE_SWEEP passes a sweep,
// the same sums in the same order (the same bits), each tile copied and decoded once a sweep.
extern "C" __global__ void __launch_bounds__(256, 2) exl3_moe_gemv_wide(
    const u8* __restrict__ arena, int halves, int codebook, const i64* __restrict__ group_base,
    const int* __restrict__ group_start, const int* __restrict__ group_len,
    const int* __restrict__ count, int cap, i64 trellis_off0,
    i64 trellis_off1, int k, int n, int per, const u32* __restrict__ xr, int entries,
    float* __restrict__ part) {
    grid_wait();
    exl3_moe_gemv_body<EXL3_WIDE_SWEEP>(arena, halves, codebook, group_base, group_start,
                                        group_len, count, cap, trellis_off0, trellis_off1, k, n,
                                        per, xr, entries, part);
}

// The activation between the products, and the down product's input rotation: for entry i
// and 128-block c of inter, gate = (sum_s part[0, s, i]) H * svh_gate, up likewise from part
// 1, a = silu(min(gate, L)) * clamp(up, -L, L), and xd[i, block c] = (a * suh_down) H in the
// GEMV's split form.
// Grid (entries, inter / 128), 128 threads.
extern "C" __global__ void exl3_moe_act(const u8* __restrict__ arena,
                                        const i64* __restrict__ entry_base, i64 svh_gate_off,
                                        i64 svh_up_off, i64 suh_down_off,
                                        const float* __restrict__ part, int splits, int entries,
                                        int inter, float limit, float* __restrict__ xd) {
    grid_wait();
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
    exl3_store_split(v, i, exl3_hadamard128(v, i), (u32*)xd + (i64)e * inter + c - i);
}

// yp[pick[i], block c] = (sum_s part[s, i, block c]) H * svh_down for entry i. part is
// [splits, entries, N]. Grid (entries, N / 128), 128 threads.
extern "C" __global__ void exl3_moe_rotate_out(const u8* __restrict__ arena,
                                               const i64* __restrict__ entry_base, i64 svh_off,
                                               const float* __restrict__ part, int splits,
                                               int entries, int n, const int* __restrict__ pick,
                                               float* __restrict__ yp) {
    grid_wait();
    __shared__ float v[128];
    const int i = threadIdx.x, e = blockIdx.x, c = blockIdx.y * 128 + i;
    float acc = 0.0f;
    for (int s = 0; s < splits; s++) acc += part[((i64)s * entries + e) * n + c];
    v[i] = acc;
    const float* svh = (const float*)(arena + entry_base[e] + svh_off);
    yp[(i64)pick[e] * n + c] = exl3_hadamard128(v, i) * svh[c];
}
