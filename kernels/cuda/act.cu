// Elementwise ops: activations, scaling and sums, the mean of the residual streams.
#include "common.cuh"

// out[i] = silu(min(gate[i], L)) * clamp(up[i], -L, L): the clamped SwiGLU.
extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                  float limit, i64 n, float* __restrict__ out) {
    grid_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(fminf(gate[i], limit)) * fminf(fmaxf(up[i], -limit), limit);
}

// x[i] *= s for i < n.
extern "C" __global__ void scale_values(float* __restrict__ x, float s, int n) {
    grid_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// y[i] += x[i] for i < n.
extern "C" __global__ void add_values(float* __restrict__ y, const float* __restrict__ x,
                                      int n) {
    grid_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

// glm5.rs's final stream mean: out[k] = (sum_i streams[i][k]) / n, summed in stream order.
extern "C" __global__ void stream_mean(const float* __restrict__ streams, int n, int d,
                                       float* __restrict__ out) {
    grid_wait();
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= d) return;
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += streams[(i64)i * d + k];
    out[k] = acc / (float)n;
}

// dst[r, j, :] = src[r, :] for j < copies: each of `rows` rows of `width` values `copies`
// times in a row (the embedding's rows as the mHC streams). One thread per value of dst.
extern "C" __global__ void repeat_rows(const float* __restrict__ src, int width, int copies,
                                       i64 total, float* __restrict__ dst) {
    grid_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const i64 row = i / ((i64)width * copies);
    dst[i] = src[row * width + i % width];
}
