// Elementwise activations.
#include "common.cuh"

// out[i] = silu(min(gate[i], L)) * clamp(up[i], -L, L): the clamped SwiGLU.
extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                  float limit, i64 n, float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(fminf(gate[i], limit)) * fminf(fmaxf(up[i], -limit), limit);
}
