// Weight-matrix products y[t, r] = W[r] . x[t] for a matrix in any weight format: one warp
// per output row (`matvec`), or one block per row for matrices of too few rows to fill the
// GPU that way (`matvec_split`); TOK_TILE tokens per pass over the row.
#include "common.cuh"

template <int FMT>
__device__ void matvec_rows(const u8* __restrict__ w, i64 rb, int rows, int cols,
                            const float* __restrict__ x, int n, float* __restrict__ y) {
    const int warps = blockDim.x / WARP;
    const int r = blockIdx.x * warps + threadIdx.x / WARP;
    if (r >= rows) return;
    const u8* row = w + (i64)r * rb;
    for (int t0 = 0; t0 < n; t0 += TOK_TILE) {
        const int nt = min(TOK_TILE, n - t0);
        float acc[TOK_TILE];
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) acc[t] = 0.0f;
        row_dots<FMT>(row, cols, x + (i64)t0 * cols, cols, nt, acc);
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) {
            const float v = warp_sum(acc[t]);
            if (t < nt && (threadIdx.x & (WARP - 1)) == 0) y[(i64)(t0 + t) * rows + r] = v;
        }
    }
}

// x: [n, cols] f32; y: [n, rows] f32; w: rows x row_bytes(fmt, cols) bytes.
extern "C" __global__ void matvec(const u8* __restrict__ w, int fmt, int rows, int cols,
                                  const float* __restrict__ x, int n, float* __restrict__ y) {
    const i64 rb = row_bytes(fmt, cols);
#define CALL(F) matvec_rows<F>(w, rb, rows, cols, x, n, y)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// Warps of a `matvec_split` block.
#define SPLIT_WARPS 8

// One block per row: warp i takes the i-th of SPLIT_WARPS column segments (whole 256-value
// super-blocks, so every format's bytes split there), and the partial dots are summed in
// warp order, so results repeat bit for bit.
template <int FMT>
__device__ void matvec_split_row(const u8* __restrict__ w, i64 rb, int cols,
                                 const float* __restrict__ x, int n, float* __restrict__ y,
                                 int rows) {
    __shared__ float part[SPLIT_WARPS][TOK_TILE];
    const int r = blockIdx.x, wid = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int seg = ((cols + SPLIT_WARPS - 1) / SPLIT_WARPS + 255) / 256 * 256;
    const int c0 = min(cols, wid * seg), c1 = min(cols, c0 + seg);
    const u8* row = w + (i64)r * rb + row_bytes(FMT, c0);
    for (int t0 = 0; t0 < n; t0 += TOK_TILE) {
        const int nt = min(TOK_TILE, n - t0);
        float acc[TOK_TILE];
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) acc[t] = 0.0f;
        if (c1 > c0) row_dots<FMT>(row, c1 - c0, x + (i64)t0 * cols + c0, cols, nt, acc);
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) {
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
    const i64 rb = row_bytes(fmt, cols);
#define CALL(F) matvec_split_row<F>(w, rb, cols, x, n, y, rows)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// out[i] = value i of an f16 or bf16 run of weights (a tile widened for cuBLAS SGEMM, so
// products of many tokens keep f32 activations). Grid-stride over `count` values.
extern "C" __global__ void widen_f32(const u16* __restrict__ w, int fmt, i64 count,
                                     float* __restrict__ out) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count;
         i += (i64)gridDim.x * blockDim.x)
        out[i] = fmt == FMT_F16 ? f16_to_f32(w[i]) : bf16_to_f32(w[i]);
}
