// mHC (manifold-constrained hyper-connections): the residual is n streams of d values per
// token. `mhc_collapse` turns a token's projection logits into its pre/post/comb weights
// (sigmoids, a row softmax and Sinkhorn balancing, in the CPU's order of operations) and
// collapses the streams into the sublayer input; `mhc_expand` writes the sublayer output
// back: new stream m = post[m] * y + sum_i comb[i][m] * stream i.
#include "common.cuh"

// Most streams the kernels take (the model uses 4); the host checks.
#define MHC_MAX_N 8

// Weights of one token from its (2 + n) n logits `l`. Run by one thread: n is tiny. Plain
// (unfused) products and sums in the CPU's order, so the weights match it closely.
__device__ void mhc_weights(const float* __restrict__ l, const float* __restrict__ base, float s0,
                            float s1, float s2, int n, float eps, int iters, float* pre,
                            float* post, float* comb) {
    for (int i = 0; i < n; i++) pre[i] = sigmoid(__fadd_rn(__fmul_rn(l[i], s0), base[i])) + eps;
    for (int i = 0; i < n; i++)
        post[i] = 2.0f * sigmoid(__fadd_rn(__fmul_rn(l[n + i], s1), base[n + i]));
    for (int i = 0; i < n; i++) {
        float* row = comb + i * n;
        const int at = 2 * n + i * n;
        float mx = __int_as_float(0xff800000);  // -inf
        for (int j = 0; j < n; j++) {
            row[j] = __fadd_rn(__fmul_rn(l[at + j], s2), base[at + j]);
            mx = fmaxf(mx, row[j]);
        }
        float sum = 0.0f;
        for (int j = 0; j < n; j++) {
            row[j] = expf(row[j] - mx);
            sum += row[j];
        }
        for (int j = 0; j < n; j++) row[j] = row[j] / sum + eps;
    }
    // Sinkhorn: columns once, then (iters - 1) times rows then columns; each sum adds eps.
    for (int it = 0; it < (iters > 1 ? iters : 1); it++) {
        if (it > 0) {
            for (int i = 0; i < n; i++) {
                float sum = 0.0f;
                for (int j = 0; j < n; j++) sum += comb[i * n + j];
                sum += eps;
                for (int j = 0; j < n; j++) comb[i * n + j] /= sum;
            }
        }
        for (int j = 0; j < n; j++) {
            float sum = 0.0f;
            for (int i = 0; i < n; i++) sum += comb[i * n + j];
            sum += eps;
            for (int i = 0; i < n; i++) comb[i * n + j] /= sum;
        }
    }
}

// logits: [T, (2 + n) n]; base: [(2 + n) n]; streams: [T, n, d]. Writes collapsed [T, d],
// post [T, n] and comb [T, n, n] (comb[t][i][m]: weight of input stream i in output m).
// Grid (ceil(d / blockDim.x), T): every block derives its token's weights itself (a few
// hundred flops), so one token's collapse spreads over many blocks; block x == 0 writes
// post and comb.
extern "C" __global__ void mhc_collapse(const float* __restrict__ logits,
                                        const float* __restrict__ base, float s0, float s1,
                                        float s2, int n, int d, float eps, int iters,
                                        const float* __restrict__ streams,
                                        float* __restrict__ collapsed, float* __restrict__ post,
                                        float* __restrict__ comb) {
    __shared__ float w_pre[MHC_MAX_N], w_post[MHC_MAX_N], w_comb[MHC_MAX_N * MHC_MAX_N];
    const int t = blockIdx.y;
    if (threadIdx.x == 0)
        mhc_weights(logits + (i64)t * (2 + n) * n, base, s0, s1, s2, n, eps, iters, w_pre, w_post,
                    w_comb);
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) post[(i64)t * n + i] = w_post[i];
        for (int i = threadIdx.x; i < n * n; i += blockDim.x)
            comb[(i64)t * n * n + i] = w_comb[i];
    }
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < d) {
        const float* s = streams + (i64)t * n * d + k;
        float acc = 0.0f;
        for (int i = 0; i < n; i++) acc = __fadd_rn(acc, __fmul_rn(w_pre[i], s[(i64)i * d]));
        collapsed[(i64)t * d + k] = acc;
    }
}

// post: [T, n]; comb: [T, n, n]; streams: [T, n, d]; y: [T, d]; out: [T, n, d] (may be
// `streams` itself: each thread reads all n values of its column before writing them).
// Grid (ceil(d / blockDim.x), T).
extern "C" __global__ void mhc_expand(const float* post, const float* comb, const float* streams,
                                      const float* y, int n, int d, float* out) {
    __shared__ float c[MHC_MAX_N * MHC_MAX_N], p[MHC_MAX_N];
    const int t = blockIdx.y;
    for (int i = threadIdx.x; i < n * n; i += blockDim.x) c[i] = comb[(i64)t * n * n + i];
    for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = post[(i64)t * n + i];
    __syncthreads();
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= d) return;
    float s[MHC_MAX_N];
#pragma unroll
    for (int i = 0; i < MHC_MAX_N; i++)
        if (i < n) s[i] = streams[((i64)t * n + i) * d + k];
    const float yk = y[(i64)t * d + k];
#pragma unroll
    for (int m = 0; m < MHC_MAX_N; m++) {
        if (m < n) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < MHC_MAX_N; i++)
                if (i < n) acc = __fadd_rn(acc, __fmul_rn(c[i * n + m], s[i]));
            out[((i64)t * n + m) * d + k] = __fadd_rn(__fmul_rn(p[m], yk), acc);
        }
    }
}
