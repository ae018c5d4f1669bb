// Weight-matrix products y[t, r] = W[r] . x[t] for a matrix in any weight format: one warp
// per output row, TOK_TILE tokens per pass over the row.
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
