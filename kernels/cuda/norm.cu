// Row norms: RMSNorm with an optional weight (none: mHC's unweighted norm), the
// sigmoid-gated RMSNorm of the KDA output, and the indexer keys' LayerNorm. One block per row.
#include "common.cuh"

// x: [rows, width] in place; weight: [width], read only when has_weight.
extern "C" __global__ void rms_norm(float* __restrict__ x, const float* __restrict__ weight,
                                    int has_weight, int width, float eps) {
    grid_wait();
    float* row = x + (i64)blockIdx.x * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss = fmaf(row[i], row[i], ss);
    const float inv = 1.0f / sqrtf(block_sum(ss) / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        row[i] = has_weight ? weight[i] * (row[i] * inv) : row[i] * inv;
}

// x, gate: [rows, width]; x = rms_norm(x) * weight * sigmoid(gate), in place.
extern "C" __global__ void gated_rms_norm(float* __restrict__ x, const float* __restrict__ gate,
                                          const float* __restrict__ weight, int width, float eps) {
    grid_wait();
    float* row = x + (i64)blockIdx.x * width;
    const float* g = gate + (i64)blockIdx.x * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss = fmaf(row[i], row[i], ss);
    const float inv = 1.0f / sqrtf(block_sum(ss) / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        row[i] = weight[i] * (row[i] * inv) * sigmoid(g[i]);
}

// ops::layer_norm: x = (x - mean) * inv * weight + bias per row of `width` (biased
// variance, eps inside the root). One block per row.
extern "C" __global__ void layer_norm(float* __restrict__ x, const float* __restrict__ weight,
                                      const float* __restrict__ bias, int width, float eps) {
    grid_wait();
    float* row = x + (i64)blockIdx.x * width;
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) s += row[i];
    const float mean = block_sum(s) / (float)width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float c = row[i] - mean;
        ss = fmaf(c, c, ss);
    }
    const float inv = 1.0f / sqrtf(block_sum(ss) / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        row[i] = (row[i] - mean) * inv * weight[i] + bias[i];
}
