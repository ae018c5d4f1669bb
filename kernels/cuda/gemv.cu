// Weight-matrix products y[t, r] = W[r] . x[t] for a matrix in any weight format: one warp
// per output row (`matvec`), or one block per row for matrices of too few rows to fill the
// GPU that way (`matvec_split`); up to TOK_TILE tokens per pass over the row.
#include "common.cuh"

template <int FMT, int TILE>
__device__ void matvec_rows(const u8* __restrict__ w, i64 rb, int rows, int cols,
                            const float* __restrict__ x, int n, float* __restrict__ y) {
    const int warps = blockDim.x / WARP;
    const int r = blockIdx.x * warps + threadIdx.x / WARP;
    if (r >= rows) return;
    const u8* row = w + (i64)r * rb;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int nt = min(TILE, n - t0);
        float acc[TILE];
#pragma unroll
        for (int t = 0; t < TILE; t++) acc[t] = 0.0f;
        row_dots<FMT, TILE>(row, cols, x + (i64)t0 * cols, cols, nt, acc);
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            const float v = warp_sum(acc[t]);
            if (t < nt && (threadIdx.x & (WARP - 1)) == 0) y[(i64)(t0 + t) * rows + r] = v;
        }
    }
}

// Rows a warp of the four-token products (`matvec_t4`, q4_k's `matvec_q_t4`); the host's grid
// reads the same knob. A tuning knob (GLMFLASH_KERNEL_DEFINES), 2 or 4.
#ifndef T4_ROWS
#define T4_ROWS 4
#endif
#if T4_ROWS != 2 && T4_ROWS != 4
#error "T4_ROWS: 2 or 4 (the values the host's grid follows)"
#endif

// Lane pass j of R float-format rows (their 16 bytes q[r], values j per .. j per + per - 1)
// against `nt` <= TILE token rows of x (`xt + t cols`, 16-byte aligned), added into
// acc[r * TILE + t]: a quarter of the 16 bytes at a time (4 values a row) for every token, so
// each sum takes its products in row_dots' order, in fewer registers than widening them whole.
template <int FMT, int TILE, int R>
__device__ __forceinline__ void rows_pass16(const uint4 (&q)[R], const float* __restrict__ xt,
                                            int cols, int j, int nt, float* acc) {
    const int per = FMT == FMT_F32 ? 4 : 8;  // values per 16 bytes
#pragma unroll
    for (int h = 0; h < per / 4; h++) {
        float v[R][4];
#pragma unroll
        for (int r = 0; r < R; r++) widen4<FMT>(q[r], h, v[r]);
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            if (t < nt) {
                const float4 a = *(const float4*)(xt + (i64)t * cols + (i64)j * per + 4 * h);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float& s = acc[r * TILE + t];
                    s = fmaf(v[r][0], a.x, s);
                    s = fmaf(v[r][1], a.y, s);
                    s = fmaf(v[r][2], a.z, s);
                    s = fmaf(v[r][3], a.w, s);
                }
            }
        }
    }
}

// The warp's sums of R rows (from r0; those from `rows` on are not stored) and `nt` <= TILE
// tokens (from t0) into y [n, rows].
template <int TILE, int R>
__device__ __forceinline__ void rows_store(const float* acc, int r0, int rows, int t0, int nt,
                                           float* __restrict__ y) {
    const int lane = threadIdx.x & (WARP - 1);
#pragma unroll
    for (int t = 0; t < TILE; t++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float v = warp_sum(acc[r * TILE + t]);
            if (t < nt && lane == 0 && r0 + r < rows) y[(i64)(t0 + t) * rows + r0 + r] = v;
        }
    }
}

// `matvec_rows` R rows a warp (rows R i .. R i + R - 1 for warp i), for the float formats and
// q4_k at a few tokens: each x value a lane loads feeds all R rows' sums, dividing the L1
// traffic of x by R (at four tokens and one row it is eight times the weights' bytes for the
// float formats: 16-byte loads of x per token for 16 bytes of weights; 28 times for q4_k).
// Each row's sums take the same products in the same order as `row_dots` gives a row alone:
// the same bits. Rows past the last compute the last row again and store nothing; the host's
// grid covers 1 / R as many warps.
// With XL (q4_k only) x's token rows are in lane-of-32 order (lane32_x_at).
template <int FMT, int TILE, int R, bool XL = false>
__device__ void matvec_rows_r(const u8* __restrict__ w, i64 rb, int rows, int cols,
                              const float* __restrict__ x, int n, float* __restrict__ y) {
    static_assert(!XL || FMT == FMT_Q4_K, "lane-of-32 x only for q4_k rows");
    const int warps = blockDim.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int r0 = R * (blockIdx.x * warps + threadIdx.x / WARP);
    if (r0 >= rows) return;
    const u8* row[R];
    unsigned long long addr = (unsigned long long)x;
#pragma unroll
    for (int r = 0; r < R; r++) {
        row[r] = w + (i64)min(r0 + r, rows - 1) * rb;
        addr |= (unsigned long long)row[r];
    }
    const int per = FMT == FMT_F32 ? 4 : 8;  // values per 16 bytes
    const bool vec = (addr & 15) == 0 && (cols & 3) == 0 && cols % per == 0;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int nt = min(TILE, n - t0);
        const float* xt = x + (i64)t0 * cols;
        float acc[R * TILE];  // row r, token t: acc[r * TILE + t]
#pragma unroll
        for (int i = 0; i < R * TILE; i++) acc[i] = 0.0f;
        if constexpr (FMT == FMT_Q4_K) {
            q4_k_lane32_rows<TILE, R, XL>(row, cols / 256, xt, cols, nt, acc);
        } else if (vec) {
            const int nv = cols / per;
#pragma unroll(TILE * R <= 4 ? 2 : 1)
            for (int j = lane; j < nv; j += WARP) {
                uint4 q[R];
#pragma unroll
                for (int r = 0; r < R; r++) q[r] = ((const uint4*)row[r])[j];
                rows_pass16<FMT, TILE, R>(q, xt, cols, j, nt, acc);
            }
        } else {
            // What row_dots takes for these rows alone (the same alignment: rb is a multiple
            // of 16 bytes whenever cols is of per values).
#pragma unroll
            for (int r = 0; r < R; r++)
                float_row_dots_scalar<FMT, TILE>(row[r], cols, xt, cols, nt, acc + r * TILE);
        }
        rows_store<TILE, R>(acc, r0, rows, t0, nt, y);
    }
}

// Threads of a warp-per-row block: the host's ROW_BLOCK.
#define ROW_THREADS 128

// Stages of the float formats' weight pipeline through shared memory (`matvec_rows_async`) at
// one token and at four; 0: none, the weights loaded to registers (`matvec_rows`,
// `matvec_rows_r`). Tuning knobs (GLMFLASH_KERNEL_DEFINES). On an H100 (session 41) four
// stages at four tokens took issue 17's four-stream step from 3.45 to 3.12 ms; stages at one
// token made it slower (the 4,096- and 12,288-row products), so T1_STAGES stays off. The ring
// is static shared memory: T4_STAGES x T4_ROWS x 2 KiB, at most 48 KiB (8 x 4 is refused).
#ifndef T1_STAGES
#define T1_STAGES 0
#endif
#ifndef T4_STAGES
#define T4_STAGES 4
#endif

// `matvec_rows_r`'s 16-byte path for the float formats with each lane's weights streamed through
// a ring of S stages in shared memory (`ring`: S * R * ROW_THREADS 16-byte slots), so a warp
// has S * R * 512 bytes of loads in flight instead of R * 512 in registers. Each lane copies and
// reads back only its own slots (its own copy groups complete for it at the wait; no barrier),
// and takes the products in `matvec_rows_r`'s order: the same bits. Only for a 16-byte-aligned
// w and x and cols a multiple of 16 bytes' values (the caller checks).
template <int FMT, int TILE, int R, int S>
__device__ void matvec_rows_async(const u8* __restrict__ w, i64 rb, int rows, int cols,
                                  const float* __restrict__ x, int n, float* __restrict__ y,
                                  uint4* ring) {
    const int warps = blockDim.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int r0 = R * (blockIdx.x * warps + threadIdx.x / WARP);
    if (r0 >= rows) return;
    const uint4* row[R];
#pragma unroll
    for (int r = 0; r < R; r++) row[r] = (const uint4*)(w + (i64)min(r0 + r, rows - 1) * rb);
    const int per = FMT == FMT_F32 ? 4 : 8;  // values per 16 bytes
    const int nv = cols / per;
    const int iters = lane < nv ? (nv - lane + WARP - 1) / WARP : 0;
    const u32 base = (u32)__cvta_generic_to_shared(ring) + 16u * threadIdx.x;
    // Slot (stage s, row r) of this thread.
    auto slot = [&](int s, int r) { return base + 16u * ROW_THREADS * (u32)(s * R + r); };
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int nt = min(TILE, n - t0);
        const float* xt = x + (i64)t0 * cols;
        float acc[R * TILE];  // row r, token t: acc[r * TILE + t]
#pragma unroll
        for (int i = 0; i < R * TILE; i++) acc[i] = 0.0f;
        // Pass i's 16 bytes of each row are this lane's j = lane + 32 i; group i holds them.
#pragma unroll
        for (int s = 0; s < S; s++) {
            if (s < iters) {
#pragma unroll
                for (int r = 0; r < R; r++) cp_async16(slot(s, r), row[r] + lane + WARP * s);
            }
            cp_async_commit();
        }
        for (int i = 0; i < iters; i++) {
            cp_async_wait<S - 1>();
            const int s = i % S, j = lane + WARP * i;
            uint4 q[R];
#pragma unroll
            for (int r = 0; r < R; r++) q[r] = ld_shared16(slot(s, r));
            rows_pass16<FMT, TILE, R>(q, xt, cols, j, nt, acc);
            // Stage s is read (its values are in registers): refill it with pass i + S.
            if (i + S < iters) {
#pragma unroll
                for (int r = 0; r < R; r++)
                    cp_async16(slot(s, r), row[r] + lane + WARP * (i + S));
            }
            cp_async_commit();
        }
        cp_async_wait<0>();
        rows_store<TILE, R>(acc, r0, rows, t0, nt, y);
    }
}

// x: [n, cols] f32; y: [n, rows] f32; w: rows x row_bytes(fmt, cols) bytes.
extern "C" __global__ void matvec(const u8* __restrict__ w, int fmt, int rows, int cols,
                                  const float* __restrict__ x, int n, float* __restrict__ y) {
    grid_wait();
    const i64 rb = row_bytes(fmt, cols);
#define CALL(F) matvec_rows<F, TOK_TILE>(w, rb, rows, cols, x, n, y)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// Warps of a `matvec_split` block.
#define SPLIT_WARPS 8

// One block per row: warp i takes the i-th of SPLIT_WARPS column segments (whole 256-value
// super-blocks, so every format's bytes split there), and the partial dots are summed in
// warp order, so results repeat bit for bit.
template <int FMT, int TILE>
__device__ void matvec_split_row(const u8* __restrict__ w, i64 rb, int cols,
                                 const float* __restrict__ x, int n, float* __restrict__ y,
                                 int rows) {
    __shared__ float part[SPLIT_WARPS][TILE];
    const int r = blockIdx.x, wid = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int seg = ((cols + SPLIT_WARPS - 1) / SPLIT_WARPS + 255) / 256 * 256;
    const int c0 = min(cols, wid * seg), c1 = min(cols, c0 + seg);
    const u8* row = w + (i64)r * rb + row_bytes(FMT, c0);
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int nt = min(TILE, n - t0);
        float acc[TILE];
#pragma unroll
        for (int t = 0; t < TILE; t++) acc[t] = 0.0f;
        if (c1 > c0) row_dots<FMT, TILE>(row, c1 - c0, x + (i64)t0 * cols + c0, cols, nt, acc);
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) part[wid][t] = v;
        }
        __syncthreads();
        if (threadIdx.x < nt) {
            float v = 0.0f;
            for (int i = 0; i < SPLIT_WARPS; i++) v += part[i][threadIdx.x];
            y[(i64)(t0 + threadIdx.x) * rows + r] = v;
        }
        __syncthreads();
    }
}

// As `matvec`; grid `rows` blocks of SPLIT_WARPS warps.
extern "C" __global__ void matvec_split(const u8* __restrict__ w, int fmt, int rows, int cols,
                                        const float* __restrict__ x, int n,
                                        float* __restrict__ y) {
    grid_wait();
    const i64 rb = row_bytes(fmt, cols);
#define CALL(F) matvec_split_row<F, TOK_TILE>(w, rb, cols, x, n, y, rows)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// `matvec` and `matvec_split` for the float formats (f32, f16, bf16) and at most T tokens a
// pass (1, 2 or 4: decode's batches): kernels of their own, so a warp holds only the
// accumulators it uses and the registers of the block formats' dots do not bound their
// occupancy. The same bits as `matvec`: each token's sum takes the same products in the same
// order whatever the tile.
// Split (a block per row): `matvec_split_row`. One token: a row a warp (`matvec_rows`); two:
// two rows a warp, four: T4_ROWS (`matvec_rows_r`; the host's grid covers as many fewer warps).
// With T1_STAGES / T4_STAGES set, `matvec_rows_async` where the rows and x allow 16-byte loads.
template <int FMT, int T, bool SPLIT>
__device__ void matvec_float_rows(const u8* __restrict__ w, i64 rb, int rows, int cols,
                                  const float* __restrict__ x, int n, float* __restrict__ y,
                                  uint4* ring) {
    constexpr int R = T == 1 ? 1 : T == 2 ? 2 : T4_ROWS;
    constexpr int S = T == 1 ? T1_STAGES : T == 4 ? T4_STAGES : 0;
    const int per = FMT == FMT_F32 ? 4 : 8;
    const bool vec = ((((unsigned long long)w | (unsigned long long)x) & 15) == 0 &&
                      (cols & 3) == 0 && cols % per == 0);
    if (SPLIT)
        matvec_split_row<FMT, T>(w, rb, cols, x, n, y, rows);
    else if (S > 0 && vec)
        matvec_rows_async<FMT, T, R, (S > 0 ? S : 1)>(w, rb, rows, cols, x, n, y, ring);
    else if (T == 1)
        matvec_rows<FMT, T>(w, rb, rows, cols, x, n, y);
    else
        matvec_rows_r<FMT, T, R>(w, rb, rows, cols, x, n, y);
}

template <int T, bool SPLIT>
__device__ void matvec_float(const u8* __restrict__ w, int fmt, int rows, int cols,
                             const float* __restrict__ x, int n, float* __restrict__ y) {
    const i64 rb = row_bytes(fmt, cols);
    constexpr int S = SPLIT ? 0 : T == 1 ? T1_STAGES : T == 4 ? T4_STAGES : 0;
    constexpr int R = T == 1 ? 1 : T == 2 ? 2 : T4_ROWS;
    // One ring for whichever format runs (S stages of R rows' 16 bytes a thread).
    static_assert(S * R * ROW_THREADS * 16 <= 48 * 1024,
                  "T1_STAGES / T4_STAGES x rows: the ring is static shared memory, at most 48 KiB");
    __shared__ uint4 ring[S > 0 ? S * R * ROW_THREADS : 1];
    switch (fmt) {
        case FMT_F32: matvec_float_rows<FMT_F32, T, SPLIT>(w, rb, rows, cols, x, n, y, ring); break;
        case FMT_F16: matvec_float_rows<FMT_F16, T, SPLIT>(w, rb, rows, cols, x, n, y, ring); break;
        default: matvec_float_rows<FMT_BF16, T, SPLIT>(w, rb, rows, cols, x, n, y, ring); break;
    }
}

#define MATVEC_ARGS                                                                       \
    const u8 *__restrict__ w, int fmt, int rows, int cols, const float *__restrict__ x, \
        int n, float *__restrict__ y
extern "C" __global__ void matvec_t1(MATVEC_ARGS) {
    grid_wait();
    matvec_float<1, false>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_t2(MATVEC_ARGS) {
    grid_wait();
    matvec_float<2, false>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_t4(MATVEC_ARGS) {
    grid_wait();
    matvec_float<4, false>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_split_t1(MATVEC_ARGS) {
    grid_wait();
    matvec_float<1, true>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_split_t2(MATVEC_ARGS) {
    grid_wait();
    matvec_float<2, true>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_split_t4(MATVEC_ARGS) {
    grid_wait();
    matvec_float<4, true>(w, fmt, rows, cols, x, n, y);
}
#undef MATVEC_ARGS

// Q4_K at one token two rows a warp (rows 2 i and 2 i + 1 for warp i), each x value a lane
// loads feeding both rows' sums: each row's sum takes `row_dots`' products in its order, so the
// same bits as `matvec_rows`. A last row without a partner computes itself twice and stores
// once. (`matvec_rows_r<FMT_Q4_K, 1, 2>` in fewer registers: no loop over token tiles.) XL: x
// in lane-of-32 order.
template <bool XL>
__device__ void matvec_q4k_pairs(const u8* __restrict__ w, i64 rb, int rows, int cols,
                                 const float* __restrict__ x, float* __restrict__ y) {
    const int warps = blockDim.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int r0 = 2 * (blockIdx.x * warps + threadIdx.x / WARP);
    if (r0 >= rows) return;
    const bool two = r0 + 1 < rows;
    const u8* row0 = w + (i64)r0 * rb;
    const u8* const pair[2] = {row0, two ? row0 + rb : row0};
    float acc[2] = {0.0f, 0.0f};
    q4_k_lane32_rows<1, 2, XL>(pair, cols / 256, x, 0, 1, acc);
    const float v0 = warp_sum(acc[0]), v1 = warp_sum(acc[1]);
    if (lane == 0) {
        y[r0] = v0;
        if (two) y[r0 + 1] = v1;
    }
}

// `matvec` and `matvec_split` for the block formats (q8_0, q4_k) at most T tokens a pass (1,
// 2 or 4: decode's batches), kernels of their own as the float formats' `matvec_t*`: a warp
// holds only the accumulators it uses. The same bits as `matvec`. q4_k without the split: two
// rows a warp (`matvec_q4k_pairs`, `matvec_rows_r`), T4_ROWS at four tokens.
template <int T, bool SPLIT>
__device__ void matvec_quant(const u8* __restrict__ w, int fmt, int rows, int cols,
                             const float* __restrict__ x, int n, float* __restrict__ y) {
    const i64 rb = row_bytes(fmt, cols);
    if (fmt == FMT_Q8_0) {
        if (SPLIT)
            matvec_split_row<FMT_Q8_0, T>(w, rb, cols, x, n, y, rows);
        else
            matvec_rows<FMT_Q8_0, T>(w, rb, rows, cols, x, n, y);
    } else if (SPLIT) {
        matvec_split_row<FMT_Q4_K, T>(w, rb, cols, x, n, y, rows);
    } else if (T == 1) {
        matvec_q4k_pairs<false>(w, rb, rows, cols, x, y);
    } else {
        matvec_rows_r<FMT_Q4_K, T, T == 2 ? 2 : T4_ROWS>(w, rb, rows, cols, x, n, y);
    }
}

#define MATVEC_ARGS                                                                       \
    const u8 *__restrict__ w, int fmt, int rows, int cols, const float *__restrict__ x, \
        int n, float *__restrict__ y
extern "C" __global__ void matvec_q_t1(MATVEC_ARGS) {
    grid_wait();
    matvec_quant<1, false>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_q_t2(MATVEC_ARGS) {
    grid_wait();
    matvec_quant<2, false>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_q_t4(MATVEC_ARGS) {
    grid_wait();
    matvec_quant<4, false>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_q_split_t1(MATVEC_ARGS) {
    grid_wait();
    matvec_quant<1, true>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_q_split_t2(MATVEC_ARGS) {
    grid_wait();
    matvec_quant<2, true>(w, fmt, rows, cols, x, n, y);
}
extern "C" __global__ void matvec_q_split_t4(MATVEC_ARGS) {
    grid_wait();
    matvec_quant<4, true>(w, fmt, rows, cols, x, n, y);
}

// q4_k's `matvec_q_t*` (cols a multiple of 256) with x's token rows in lane-of-32 order
// (`lane32_x`): a warp's float4 loads of x touch four 128-byte lines where in order they touch
// sixteen (at four tokens and four rows a warp x was ~0.9 of the L1 lines a pass). The same
// products in the same order: the same bits as `matvec_q_t*`. `fmt` is q4_k's (unread).
extern "C" __global__ void matvec_q4k_xl_t1(MATVEC_ARGS) {
    grid_wait();
    matvec_q4k_pairs<true>(w, row_bytes(FMT_Q4_K, cols), rows, cols, x, y);
}
extern "C" __global__ void matvec_q4k_xl_t2(MATVEC_ARGS) {
    grid_wait();
    matvec_rows_r<FMT_Q4_K, 2, 2, true>(w, row_bytes(FMT_Q4_K, cols), rows, cols, x, n, y);
}
extern "C" __global__ void matvec_q4k_xl_t4(MATVEC_ARGS) {
    grid_wait();
    matvec_rows_r<FMT_Q4_K, 4, T4_ROWS, true>(w, row_bytes(FMT_Q4_K, cols), rows, cols, x, n, y);
}
#undef MATVEC_ARGS

// xp = x with each run of 256 values in lane-of-32 order (lane32_x_at): the token rows that q4_k
// rows read as `matvec_q4k_xl_t*` and moe_gate_up read them. n values (rows of a multiple of 256
// laid end to end), a float4 a thread.
extern "C" __global__ void lane32_x(const float* __restrict__ x, i64 n, float* __restrict__ xp) {
    grid_wait();
    const i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x;  // xp's float4
    if (q >= n / 4) return;
    // xp's float4 (2 k + p) * 8 + 2 c + h of a run holds x's values 64 c + 32 p + 16 h + 4 k ..
    const int d = (int)(q & 63), j = d & 7, m = d >> 3;
    const i64 at = 4 * (q - d) + lane32_x_at<false>(0, j >> 1, j & 1, m >> 1, m & 1);
    ((float4*)xp)[q] = *(const float4*)(x + at);
}

// out[i] = value i of an f16 or bf16 run of weights (a tile widened for cuBLAS SGEMM, so
// products of many tokens keep f32 activations). Grid-stride over `count` values.
extern "C" __global__ void widen_f32(const u16* __restrict__ w, int fmt, i64 count,
                                     float* __restrict__ out) {
    grid_wait();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count;
         i += (i64)gridDim.x * blockDim.x)
        out[i] = fmt == FMT_F16 ? f16_to_f32(w[i]) : bf16_to_f32(w[i]);
}

// Value i of a row of weights in format FMT, computed as row_dots computes it (the same f32
// operations, so the same value).
template <int FMT>
__device__ __forceinline__ float row_value(const u8* __restrict__ row, int i) {
    if (FMT == FMT_F32) return ((const float*)row)[i];
    if (FMT == FMT_F16) return f16_to_f32(load_u16(row + 2 * (i64)i));
    if (FMT == FMT_BF16) return bf16_to_f32(load_u16(row + 2 * (i64)i));
    if (FMT == FMT_Q8_0) {
        const u8* blk = row + (i64)(i / 32) * 34;
        return f16_to_f32(load_u16(blk)) * (float)(signed char)blk[2 + i % 32];
    }
    // Q4_K: value j of a 144-byte super-block is nibble h of byte 32 c + q of its quants
    // (j = 64 c + 32 h + q), in sub-block 2 c + h (see row_dots).
    const u8* blk = row + (i64)(i / 256) * 144;
    const int j = i % 256, c = j / 64, h = (j / 32) & 1, q = j % 32, sb = 2 * c + h;
    const u8* s = blk + 4;
    int sc, m;
    if (sb < 4) {
        sc = s[sb] & 63;
        m = s[sb + 4] & 63;
    } else {
        sc = (s[sb + 4] & 0x0F) | ((s[sb - 4] >> 6) << 4);
        m = (s[sb + 4] >> 4) | ((s[sb] >> 6) << 4);
    }
    const float ds = f16_to_f32(load_u16(blk)) * (float)sc;
    const float dm = f16_to_f32(load_u16(blk + 2)) * (float)m;
    const u32 byte = blk[16 + 32 * c + q];
    return ds * (float)(h ? byte >> 4 : byte & 0x0F) - dm;
}

// out[r, i] = value i of row r of `rows` rows of `cols` weights in format `fmt` (a routed
// expert's matrix widened for cuBLAS SGEMM over a prompt chunk's picks). A block per row.
extern "C" __global__ void dequant_rows(const u8* __restrict__ w, int fmt, int rows, int cols,
                                        float* __restrict__ out) {
    grid_wait();
    const u8* row = w + (i64)blockIdx.x * row_bytes(fmt, cols);
    float* dst = out + (i64)blockIdx.x * cols;
#define CALL(F)                                                               \
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = row_value<F>(row, i);
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// x as three bf16 planes for cuBLAS's bf16 tensor-core GEMM (`count` values of x, planes of
// `count` halves each, back to back): p0 = bf16(x), p1 = bf16(x - p0), p2 = bf16(x - p0 - p1),
// each rounded to nearest, so p0 + p1 + p2 carries x's 24 significant bits (bf16 has f32's
// exponent range). Grid-stride.
extern "C" __global__ void split_bf16x3(const float* __restrict__ x, i64 count,
                                        u16* __restrict__ planes) {
    grid_wait();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count;
         i += (i64)gridDim.x * blockDim.x) {
        const float v = x[i];
        const u16 a = f32_to_bf16_rn(v);
        const float r = v - bf16_to_f32(a);
        const u16 b = f32_to_bf16_rn(r);
        planes[i] = a;
        planes[count + i] = b;
        planes[2 * count + i] = f32_to_bf16_rn(r - bf16_to_f32(b));
    }
}
