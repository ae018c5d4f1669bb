// mHC (manifold-constrained hyper-connections): the residual is n streams of d values per
// token. `mhc_collapse` turns a token's projection logits into its pre/post/comb weights
// (sigmoids, a row softmax and Sinkhorn balancing, in the CPU's order of operations) and
// collapses the streams into the sublayer input; `mhc_expand` writes the sublayer output
// back: new stream m = post[m] * y + sum_i comb[i][m] * stream i.
#include "common.cuh"

// Most streams the kernels take (the model uses 4); the host checks.
#define MHC_MAX_N 8

// Weights of one token from its (2 + n) n logits `l`, written to shared `pre`, `post` and
// `comb`. Run by the block's first n * n threads together: thread (i, j) = (tid / n, tid % n)
// owns comb[i][j], and pre/post[tid] for tid < n. Every sum still adds its n terms one by one
// in the CPU's order (each thread of a row or column reads them all from shared memory), and
// every product, sum and quotient is unfused, so the weights equal the one-thread version's;
// the n * n entries of a Sinkhorn step run at once instead of one after another.
// Ends with the weights visible to the whole block.
__device__ void mhc_weights(const float* __restrict__ l, const float* __restrict__ base, float s0,
                            float s1, float s2, int n, float eps, int iters, float* pre,
                            float* post, float* comb) {
    const int tid = threadIdx.x, nn = n * n;
    const bool own = tid < nn;
    const int i = own ? tid / n : 0, j = own ? tid % n : 0;
    if (tid < n) {
        pre[tid] = sigmoid(__fadd_rn(__fmul_rn(l[tid], s0), base[tid])) + eps;
        post[tid] = 2.0f * sigmoid(__fadd_rn(__fmul_rn(l[n + tid], s1), base[n + tid]));
    }
    // Row softmax: every thread of row i computes the row's max and sum itself.
    if (own) comb[tid] = __fadd_rn(__fmul_rn(l[2 * n + tid], s2), base[2 * n + tid]);
    __syncthreads();
    float v = 0.0f;
    if (own) {
        float mx = __int_as_float(0xff800000);  // -inf
        for (int c = 0; c < n; c++) mx = fmaxf(mx, comb[i * n + c]);
        float sum = 0.0f;
        for (int c = 0; c < n; c++) sum += expf(comb[i * n + c] - mx);
        v = expf(comb[tid] - mx) / sum + eps;
    }
    __syncthreads();
    if (own) comb[tid] = v;
    __syncthreads();
    // Sinkhorn: columns once, then (iters - 1) times rows then columns; each sum adds eps.
    for (int it = 0; it < (iters > 1 ? iters : 1); it++) {
        if (it > 0) {
            if (own) {
                float sum = 0.0f;
                for (int c = 0; c < n; c++) sum += comb[i * n + c];
                sum += eps;
                v = comb[tid] / sum;
            }
            __syncthreads();
            if (own) comb[tid] = v;
            __syncthreads();
        }
        if (own) {
            float sum = 0.0f;
            for (int r = 0; r < n; r++) sum += comb[r * n + j];
            sum += eps;
            v = comb[tid] / sum;
        }
        __syncthreads();
        if (own) comb[tid] = v;
        __syncthreads();
    }
}

// logits: [T, (2 + n) n]; base: [(2 + n) n]; streams: [T, n, d]. Writes collapsed [T, d],
// post [T, n] and comb [T, n, n] (comb[t][i][m]: weight of input stream i in output m).
// Grid (ceil(d / blockDim.x), T), blockDim.x >= n * n: every block derives its token's weights
// itself (a few hundred flops), so one token's collapse spreads over many blocks; block x == 0
// writes post and comb.
extern "C" __global__ void mhc_collapse(const float* __restrict__ logits,
                                        const float* __restrict__ base, float s0, float s1,
                                        float s2, int n, int d, float eps, int iters,
                                        const float* __restrict__ streams,
                                        float* __restrict__ collapsed, float* __restrict__ post,
                                        float* __restrict__ comb) {
    __shared__ float w_pre[MHC_MAX_N], w_post[MHC_MAX_N], w_comb[MHC_MAX_N * MHC_MAX_N];
    const int t = blockIdx.y;
    mhc_weights(logits + (i64)t * (2 + n) * n, base, s0, s1, s2, n, eps, iters, w_pre, w_post,
                w_comb);
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
