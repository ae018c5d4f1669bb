// KDA (Kimi delta attention): the depthwise causal conv + SiLU on q|k|v, and the delta-rule
// recurrence per head.
#include "common.cuh"

// Longest conv kernel `kda_conv` takes (the model uses 4); the host checks.
#define KDA_MAX_CONV 8
// Tokens one `kda_conv` thread carries through its channel.
#define KDA_CONV_SEG 64
// State columns per `kda_recurrent` block: one warp, one column per lane.
#define KDA_COLS 32

// One channel over tokens [t0, t1): the window of K inputs lives in registers. Window row r
// is conv state row r for r < K - 1, else input row r - (K - 1); token t reads rows
// t .. t + K - 1, the last of them its own input.
template <int K>
__device__ __forceinline__ void conv_segment(const float* __restrict__ qkv,
                                             const float* __restrict__ state,
                                             const float* __restrict__ taps, int ch, int t0,
                                             int t1, int w, float* __restrict__ out) {
    const int hist = K - 1;
    float tap[K], win[K];
#pragma unroll
    for (int j = 0; j < K; j++) tap[j] = taps[(i64)ch * K + j];
#pragma unroll
    for (int j = 0; j < K - 1; j++) {
        const int r = t0 + j;
        win[j] = r < hist ? state[(i64)r * w + ch] : qkv[(i64)(r - hist) * w + ch];
    }
    for (int t = t0; t < t1; t++) {
        win[K - 1] = qkv[(i64)t * w + ch];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < K; j++) acc = __fadd_rn(acc, __fmul_rn(tap[j], win[j]));
        out[(i64)t * w + ch] = silu(acc);
#pragma unroll
        for (int j = 0; j + 1 < K; j++) win[j] = win[j + 1];
    }
}

// qkv: [len, w] conv inputs; state: [K - 1, w] the previous inputs, oldest first (only read:
// `kda_conv_state` advances it after this kernel); taps: [w, K]; out: [len, w] =
// silu(causal depthwise conv). Grid (ceil(w / blockDim.x), ceil(len / KDA_CONV_SEG)).
extern "C" __global__ void kda_conv(const float* __restrict__ qkv, const float* __restrict__ state,
                                    const float* __restrict__ taps, int len, int w, int kernel,
                                    float* __restrict__ out) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= w) return;
    const int t0 = blockIdx.y * KDA_CONV_SEG;
    const int t1 = min(len, t0 + KDA_CONV_SEG);
#define KDA_CONV_CASE(K) \
    case K: conv_segment<K>(qkv, state, taps, ch, t0, t1, w, out); break;
    switch (kernel) {
        KDA_CONV_CASE(1)
        KDA_CONV_CASE(2)
        KDA_CONV_CASE(3)
        KDA_CONV_CASE(4)
        KDA_CONV_CASE(5)
        KDA_CONV_CASE(6)
        KDA_CONV_CASE(7)
        KDA_CONV_CASE(8)
        default: break;
    }
#undef KDA_CONV_CASE
}

// Advances the conv state past `len` inputs: row r becomes window row len + r. One thread per
// channel, rows in ascending order, so a state row still to be read (len + r < K - 1) is
// read before its own turn overwrites it. Grid ceil(w / blockDim.x).
extern "C" __global__ void kda_conv_state(float* __restrict__ state, const float* __restrict__ qkv,
                                          int len, int w, int kernel) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= w) return;
    const int hist = kernel - 1;
    for (int r = 0; r < hist; r++) {
        const int src = len + r;
        state[(i64)r * w + ch] =
            src < hist ? state[(i64)src * w + ch] : qkv[(i64)(src - hist) * w + ch];
    }
}

// The delta rule over `len` tokens, token after token. mixed: [len, 3C] (q | k | v after
// the conv), C = heads * d; g: [len, C] log decay; beta: [len, heads]; state: [heads, d, d]
// (row i: key channel, column j: value channel), updated in place; out: [len, C].
//
// Per token, q and k are l2-normalised (q then scaled), the state decays by exp(g) per row,
// mem = k^T S, S += k ((v - mem) beta)^T and o = q^T S. Column j of S evolves on its own
// given the head's q, k, g and beta, so a block (one warp) takes KDA_COLS columns of one
// head, keeps them in shared memory across all tokens and writes them back at the end; each
// lane reads and writes only its own column. Grid (ceil(d / KDA_COLS), heads), block
// KDA_COLS threads, dynamic shared memory (KDA_COLS + 3) * d floats.
extern "C" __global__ void kda_recurrent(const float* __restrict__ mixed,
                                         const float* __restrict__ g,
                                         const float* __restrict__ beta, int len, int heads, int d,
                                         float scale, float eps, float* __restrict__ state,
                                         float* __restrict__ out) {
    extern __shared__ float sh[];
    float* s = sh;                  // [d][KDA_COLS]
    float* qs = s + d * KDA_COLS;  // [d] normalised, scaled q
    float* ks = qs + d;             // [d] normalised k
    float* decay = ks + d;          // [d] exp(g)
    const int lane = threadIdx.x;
    const int head = blockIdx.y;
    const int j = blockIdx.x * KDA_COLS + lane;
    const bool active = j < d;
    const i64 c = (i64)heads * d;
    float* sg = state + (i64)head * d * d;
    float* col = s + lane;
    if (active)
        for (int i = 0; i < d; i++) col[i * KDA_COLS] = sg[(i64)i * d + j];
    for (int t = 0; t < len; t++) {
        const float* qt = mixed + (i64)t * 3 * c + (i64)head * d;
        const float* kt = qt + c;
        const float* vt = qt + 2 * c;
        const float* gt = g + (i64)t * c + (i64)head * d;
        float qq = 0.0f, kk = 0.0f;
        for (int i = lane; i < d; i += WARP) {
            qq = fmaf(qt[i], qt[i], qq);
            kk = fmaf(kt[i], kt[i], kk);
        }
        const float qn = sqrtf(warp_sum(qq) + eps), kn = sqrtf(warp_sum(kk) + eps);
        __syncthreads();  // the previous token is done with qs, ks and decay
        for (int i = lane; i < d; i += WARP) {
            qs[i] = (qt[i] / qn) * scale;
            ks[i] = kt[i] / kn;
            decay[i] = expf(gt[i]);
        }
        __syncthreads();
        if (active) {
            float mem = 0.0f;
            for (int i = 0; i < d; i++) {
                const float x = col[i * KDA_COLS] * decay[i];
                col[i * KDA_COLS] = x;
                mem = fmaf(ks[i], x, mem);
            }
            const float delta = (vt[j] - mem) * beta[(i64)t * heads + head];
            float o = 0.0f;
            for (int i = 0; i < d; i++) {
                const float x = fmaf(ks[i], delta, col[i * KDA_COLS]);
                col[i * KDA_COLS] = x;
                o = fmaf(qs[i], x, o);
            }
            out[(i64)t * c + (i64)head * d + j] = o;
        }
    }
    if (active)
        for (int i = 0; i < d; i++) sg[(i64)i * d + j] = col[i * KDA_COLS];
}
