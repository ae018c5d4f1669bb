// Small kernels of the GPU-resident decode step (backend/cuda/decode.rs): KDA's forget gate
// and beta, the indexer key's LayerNorm, MLA's weight absorption on an f32 copy of kv_b,
// elementwise scale and add, and the final stream mean. Each matches the CPU op named in
// its comment in order of operations.
#include "common.cuh"

// kda.rs `forget_gate` on g = f_b(f_a(x)) in place ([tokens, channels]), and beta =
// sigmoid(b) in place ([tokens, heads]). With a bound: g = bound * sigmoid(exp(a_log[h]) *
// (g + dt_bias)); without: g = -exp(a_log[h]) * softplus(g + dt_bias) (softplus linear above
// 20). Grid y over tokens.
extern "C" __global__ void kda_gates(float* __restrict__ g, const float* __restrict__ dt_bias,
                                     const float* __restrict__ a_log, int head_dim,
                                     int channels, int has_bound, float bound,
                                     float* __restrict__ beta, int heads) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    g += (i64)blockIdx.y * channels;
    beta += (i64)blockIdx.y * heads;
    if (i < channels) {
        const float rate = expf(a_log[i / head_dim]);
        const float pre = g[i] + dt_bias[i];
        if (has_bound) {
            g[i] = bound * sigmoid(rate * pre);
        } else {
            const float softplus = pre > 20.0f ? pre : logf(1.0f + expf(pre));
            g[i] = -rate * softplus;
        }
    }
    if (i < heads) beta[i] = sigmoid(beta[i]);
}

// ops::layer_norm: x = (x - mean) * inv * weight + bias per row of `width` (biased
// variance, eps inside the root). One block per row.
extern "C" __global__ void layer_norm(float* __restrict__ x, const float* __restrict__ weight,
                                      const float* __restrict__ bias, int width, float eps) {
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

// x[i] *= s for i < n.
extern "C" __global__ void scale_values(float* __restrict__ x, float s, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// y[i] += x[i] for i < n.
extern "C" __global__ void add_values(float* __restrict__ y, const float* __restrict__ x,
                                      int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

// MLA absorption of the query (mla.rs `attend_absorbed`): per head,
// q_lat[head][c] = sum_{i < nope} q[head][i] * kv_b[head * (nope + vd) + i][c], summed in
// order of i as the CPU's axpy loop. kv_b is f32 `[heads * (nope + vd), rank]`; one thread
// per (head, c): grid x over rank, grid y over heads, grid z over tokens (q is
// `[tokens, heads, nope]`, q_lat `[tokens, heads, rank]`).
extern "C" __global__ void mla_absorb_q(const float* __restrict__ q,
                                        const float* __restrict__ kv_b, int nope, int vd,
                                        int rank, float* __restrict__ q_lat) {
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

// glm5.rs's final stream mean: out[k] = (sum_i streams[i][k]) / n, summed in stream order.
extern "C" __global__ void stream_mean(const float* __restrict__ streams, int n, int d,
                                       float* __restrict__ out) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= d) return;
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += streams[(i64)i * d + k];
    out[k] = acc / (float)n;
}

// KDA's conv input per token: the q, k and v projections (`[tokens, width]` each) side by
// side, `[tokens, 3 * width]` (q | k | v), the layout kda_conv reads.
extern "C" __global__ void interleave3(const float* __restrict__ a, const float* __restrict__ b,
                                       const float* __restrict__ c, int tokens, int width,
                                       float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)tokens * width) return;
    const i64 t = i / width, k = i % width;
    float* row = out + t * 3 * width;
    row[k] = a[i];
    row[width + k] = b[i];
    row[2 * width + k] = c[i];
}
