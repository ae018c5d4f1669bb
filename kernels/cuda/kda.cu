// KDA (Kimi delta attention): the forget gate and beta, q|k|v packed for the conv, the
// depthwise causal conv + SiLU on q|k|v, and the delta-rule recurrence per head, token by
// token (decode) or in chunks (prefill).
#include "common.cuh"

// Longest conv kernel `kda_conv` takes (the model uses 4); the host checks.
#define KDA_MAX_CONV 8
// Tokens one `kda_conv` thread carries through its channel.
#define KDA_CONV_SEG 64
// State columns per `kda_recurrent` block: one column per lane of each of its warps.
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

// Advances channel ch's conv state past `len` inputs: row r becomes window row len + r, rows
// in ascending order, so a state row still to be read (len + r < K - 1) is read before its own
// turn overwrites it.
__device__ __forceinline__ void conv_advance(float* state, const float* __restrict__ qkv, int ch,
                                             int len, int w, int kernel) {
    const int hist = kernel - 1;
    for (int r = 0; r < hist; r++) {
        const int src = len + r;
        state[(i64)r * w + ch] =
            src < hist ? state[(i64)src * w + ch] : qkv[(i64)(src - hist) * w + ch];
    }
}

// One channel's conv over tokens [t0, t1), the kernel size chosen at run time.
__device__ __forceinline__ void conv_channel(const float* __restrict__ qkv, const float* state,
                                             const float* __restrict__ taps, int ch, int t0,
                                             int t1, int w, int kernel, float* __restrict__ out) {
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

// qkv: [len, w] conv inputs; state: [K - 1, w] the previous inputs, oldest first; taps:
// [w, K]; out: [len, w] = silu(causal depthwise conv). Grid (ceil(w / blockDim.x),
// ceil(len / KDA_CONV_SEG)). With `advance` (one token segment: a thread then owns its
// channel's every read) each thread also advances its channel's state after its conv;
// else `kda_conv_state` does it after this kernel.
extern "C" __global__ void kda_conv(const float* __restrict__ qkv, float* state,
                                    const float* __restrict__ taps, int len, int w, int kernel,
                                    int advance, float* __restrict__ out) {
    grid_wait();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= w) return;
    const int t0 = blockIdx.y * KDA_CONV_SEG;
    conv_channel(qkv, state, taps, ch, t0, min(len, t0 + KDA_CONV_SEG), w, kernel, out);
    if (advance) conv_advance(state, qkv, ch, len, w, kernel);
}

// A decode step of several sequences, one token each: sequence s (grid y) takes row s of
// qkv and out and its own conv state `states[s]`, exactly as `kda_conv` with len 1 does.
// Grid (ceil(w / blockDim.x), sequences).
extern "C" __global__ void kda_conv_seqs(const float* __restrict__ qkv, float* const* states,
                                         const float* __restrict__ taps, int w, int kernel,
                                         float* __restrict__ out) {
    grid_wait();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= w) return;
    const i64 row = (i64)blockIdx.y * w;
    float* state = states[blockIdx.y];
    conv_channel(qkv + row, state, taps, ch, 0, 1, w, kernel, out + row);
    conv_advance(state, qkv + row, ch, 1, w, kernel);
}

// Advances the conv state past `len` inputs (`conv_advance`), one thread per channel, after
// a `kda_conv` of several token segments. Grid ceil(w / blockDim.x).
extern "C" __global__ void kda_conv_state(float* __restrict__ state, const float* __restrict__ qkv,
                                          int len, int w, int kernel) {
    grid_wait();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= w) return;
    conv_advance(state, qkv, ch, len, w, kernel);
}

// The delta rule over `len` tokens, token after token. mixed: [len, 3C] (q | k | v after
// the conv), C = heads * d; g: [len, C] log decay; beta: [len, heads]; state: [heads, d, d]
// (row i: key channel, column j: value channel), updated in place; out: [len, C].
//
// Per token, q and k are l2-normalised (q then scaled), the state decays by exp(g) per row,
// mem = k^T S, S += k ((v - mem) beta)^T and o = q^T S. Column j of S evolves on its own
// given the head's q, k, g and beta, so a block takes KDA_COLS columns of one head: lane l
// of warp w holds rows 32 w .. 32 w + 31 of column l in registers across all tokens (loaded
// once, all in flight, and written back at the end), and the two dots over a column are
// each warp's partial sum over its rows, added in warp order. Grid (ceil(d / KDA_COLS),
// heads), block KDA_COLS x ceil(d / 32) threads, dynamic shared memory (3 d + 2 * 32 *
// warps) floats.
__device__ __forceinline__ void recurrent_span(const float* __restrict__ mixed,
                                               const float* __restrict__ g,
                                               const float* __restrict__ beta, int len, int heads,
                                               int d, float scale, float eps,
                                               float* __restrict__ state,
                                               float* __restrict__ out, float* sh) {
    const int warps = blockDim.x / WARP;
    float* qs = sh;                      // [d] normalised, scaled q
    float* ks = qs + d;                  // [d] normalised k
    float* decay = ks + d;               // [d] exp(g)
    float* part = decay + d;             // [2][warps][KDA_COLS] the warps' partial dots
    const int lane = threadIdx.x & (WARP - 1), w = threadIdx.x / WARP;
    const int head = blockIdx.y;
    const int j = blockIdx.x * KDA_COLS + lane;
    const bool active = j < d;
    const int r0 = w * WARP;  // this thread's first row
    const i64 c = (i64)heads * d;
    float* sg = state + (i64)head * d * d;
    float col[WARP];
#pragma unroll
    for (int r = 0; r < WARP; r++)
        col[r] = active && r0 + r < d ? sg[(i64)(r0 + r) * d + j] : 0.0f;
    for (int t = 0; t < len; t++) {
        const float* qt = mixed + (i64)t * 3 * c + (i64)head * d;
        const float* kt = qt + c;
        const float* vt = qt + 2 * c;
        const float* gt = g + (i64)t * c + (i64)head * d;
        // Every warp forms the same norms the same way.
        float qq = 0.0f, kk = 0.0f;
        for (int i = lane; i < d; i += WARP) {
            qq = fmaf(qt[i], qt[i], qq);
            kk = fmaf(kt[i], kt[i], kk);
        }
        const float qn = sqrtf(warp_sum(qq) + eps), kn = sqrtf(warp_sum(kk) + eps);
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            qs[i] = (qt[i] / qn) * scale;
            ks[i] = kt[i] / kn;
            decay[i] = expf(gt[i]);
        }
        __syncthreads();
        float mem = 0.0f;
#pragma unroll
        for (int r = 0; r < WARP; r++)
            if (r0 + r < d) {
                const float x = col[r] * decay[r0 + r];
                col[r] = x;
                mem = fmaf(ks[r0 + r], x, mem);
            }
        part[w * KDA_COLS + lane] = mem;
        __syncthreads();
        mem = 0.0f;
        for (int i = 0; i < warps; i++) mem += part[i * KDA_COLS + lane];
        const float delta = active ? (vt[j] - mem) * beta[(i64)t * heads + head] : 0.0f;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < WARP; r++)
            if (r0 + r < d) {
                const float x = fmaf(ks[r0 + r], delta, col[r]);
                col[r] = x;
                o = fmaf(qs[r0 + r], x, o);
            }
        part[(warps + w) * KDA_COLS + lane] = o;
        __syncthreads();
        if (w == 0 && active) {
            o = 0.0f;
            for (int i = 0; i < warps; i++) o += part[(warps + i) * KDA_COLS + lane];
            out[(i64)t * c + (i64)head * d + j] = o;
        }
        __syncthreads();  // the next token rewrites qs, ks, decay and part
    }
#pragma unroll
    for (int r = 0; r < WARP; r++)
        if (active && r0 + r < d) sg[(i64)(r0 + r) * d + j] = col[r];
}

extern "C" __global__ void kda_recurrent(const float* __restrict__ mixed,
                                         const float* __restrict__ g,
                                         const float* __restrict__ beta, int len, int heads, int d,
                                         float scale, float eps, float* __restrict__ state,
                                         float* __restrict__ out) {
    grid_wait();
    extern __shared__ float sh[];
    recurrent_span(mixed, g, beta, len, heads, d, scale, eps, state, out, sh);
}

// A decode step of several sequences, one token each: sequence s (grid z) takes row s of
// mixed, g, beta and out and its own state `states[s]`, exactly as `kda_recurrent` with len
// 1 does. Grid (ceil(d / KDA_COLS), heads, sequences), the block and shared memory of
// `kda_recurrent`.
extern "C" __global__ void kda_recurrent_seqs(const float* __restrict__ mixed,
                                              const float* __restrict__ g,
                                              const float* __restrict__ beta, int heads, int d,
                                              float scale, float eps, float* const* states,
                                              float* __restrict__ out) {
    grid_wait();
    extern __shared__ float sh[];
    const i64 s = blockIdx.z, c = (i64)heads * d;
    recurrent_span(mixed + s * 3 * c, g + s * c, beta + s * heads, 1, heads, d, scale, eps,
                   states[s], out + s * c, sh);
}

// Tokens per chunk of `kda_chunked`: its working set for d = 128 stays under the 48 KB of
// shared memory every device grants without an opt-in.
#define KDA_CHUNK 16
// Warps of a `kda_chunked` block; each takes KDA_CHUNK_TOKENS tokens of a chunk.
#define KDA_CHUNK_WARPS 4
#define KDA_CHUNK_THREADS (KDA_CHUNK_WARPS * WARP)
#define KDA_CHUNK_TOKENS (KDA_CHUNK / KDA_CHUNK_WARPS)
// (t, s) pairs of a chunk per thread.
#define KDA_CHUNK_PAIRS (KDA_CHUNK * KDA_CHUNK / KDA_CHUNK_THREADS)

// What `kda_recurrent` computes (same arguments, same layouts), in the chunked form: a block
// takes KDA_COLS state columns of one head through the span KDA_CHUNK tokens at a time.
// Within a chunk, with G_t the cumulative log decay (per key channel) up to token t, S the
// state before the chunk and e_ts = exp(G_t - G_s) for s <= t (never above 1, as g <= 0):
//   A[t][s] = beta_t sum_i k_t[i] k_s[i] e_ts[i]  (s < t)
//   P[t][s] = sum_i q_t[i] k_s[i] e_ts[i]         (s <= t)
//   U[t] = beta_t (v_t - (k_t exp(G_t))^T S) - sum_{s<t} A[t][s] U[s]  (forward substitution)
//   o_t = (q_t exp(G_t))^T S + sum_{s<=t} P[t][s] U[s]
//   S <- exp(G_last) S + sum_s (k_s exp(G_last - G_s)) U[s]^T
// U[t] is the delta (v - mem) beta the recurrence adds at token t. A and P depend only on
// the head, so each of a head's column blocks computes them; the state columns never leave
// shared memory. Lanes are state columns wherever S or U is touched. The chunk's rows of q,
// k and G have an odd stride, so threads reading 16 rows at one channel hit 16 banks.
// Grid (ceil(d / KDA_COLS), heads), block KDA_CHUNK_THREADS, dynamic shared memory
// (KDA_COLS + 1) * d + 3 * KDA_CHUNK * (d | 1) + (2 * KDA_CHUNK + KDA_COLS + 1) * KDA_CHUNK
// floats.
extern "C" __global__ void kda_chunked(const float* __restrict__ mixed,
                                       const float* __restrict__ g,
                                       const float* __restrict__ beta, int len, int heads, int d,
                                       float scale, float eps, float* __restrict__ state,
                                       float* __restrict__ out) {
    grid_wait();
    extern __shared__ float sh[];
    const int ld = d | 1;
    float* s = sh;                           // [d][KDA_COLS]
    float* qc = s + d * KDA_COLS;            // [KDA_CHUNK][ld] q normalised and scaled
    float* kc = qc + KDA_CHUNK * ld;         // [KDA_CHUNK][ld] k normalised
    float* gc = kc + KDA_CHUNK * ld;         // [KDA_CHUNK][ld] G
    float* last_decay = gc + KDA_CHUNK * ld; // [d] exp(G_last)
    float* a = last_decay + d;               // [KDA_CHUNK][KDA_CHUNK]
    float* p = a + KDA_CHUNK * KDA_CHUNK;    // [KDA_CHUNK][KDA_CHUNK]
    float* u = p + KDA_CHUNK * KDA_CHUNK;    // [KDA_CHUNK][KDA_COLS]
    float* bc = u + KDA_CHUNK * KDA_COLS;    // [KDA_CHUNK] beta
    // Once A and P are made, the chunk's rows are rewritten in place to what the rest reads:
    float* q_decayed = qc;  // q_t exp(G_t)
    float* k_to_last = kc;  // k_s exp(G_last - G_s)
    float* k_decayed = gc;  // k_t exp(G_t)
    const int tid = threadIdx.x, lane = tid & (WARP - 1), warp = tid / WARP;
    const int head = blockIdx.y;
    const int j = blockIdx.x * KDA_COLS + lane;
    const bool active = j < d;
    const i64 c = (i64)heads * d;
    float* sg = state + (i64)head * d * d;
    // Columns past d stay zero, so every lane runs the same arithmetic and stores nothing.
    for (int i = warp; i < d; i += KDA_CHUNK_WARPS)
        s[i * KDA_COLS + lane] = active ? sg[(i64)i * d + j] : 0.0f;
    for (int t0 = 0; t0 < len; t0 += KDA_CHUNK) {
        const int n = min(KDA_CHUNK, len - t0);
        // This warp's tokens are warp + KDA_CHUNK_WARPS * r for r < mine (n >= 1, so the
        // numerator is positive).
        const int mine =
            min(KDA_CHUNK_TOKENS, (n - warp + KDA_CHUNK_WARPS - 1) / KDA_CHUNK_WARPS);
        __syncthreads();  // the previous chunk is done with every array but s
        for (int r = 0; r < mine; r++) {
            const int t = warp + KDA_CHUNK_WARPS * r;
            const float* qt = mixed + (i64)(t0 + t) * 3 * c + (i64)head * d;
            const float* kt = qt + c;
            float qq = 0.0f, kk = 0.0f;
            for (int i = lane; i < d; i += WARP) {
                qq = fmaf(qt[i], qt[i], qq);
                kk = fmaf(kt[i], kt[i], kk);
            }
            const float qn = sqrtf(warp_sum(qq) + eps), kn = sqrtf(warp_sum(kk) + eps);
            for (int i = lane; i < d; i += WARP) {
                qc[t * ld + i] = (qt[i] / qn) * scale;
                kc[t * ld + i] = kt[i] / kn;
            }
        }
        for (int i = tid; i < d; i += KDA_CHUNK_THREADS) {
            float acc = 0.0f;
#pragma unroll
            for (int t = 0; t < KDA_CHUNK; t++) {
                if (t < n) {
                    acc += g[(i64)(t0 + t) * c + (i64)head * d + i];
                    gc[t * ld + i] = acc;
                }
            }
        }
        if (tid < n) bc[tid] = beta[(i64)(t0 + tid) * heads + head];
        __syncthreads();
        // A thread takes source token s and KDA_CHUNK_PAIRS target tokens t, each pair's sums
        // over the channels on its own (no reductions across threads).
        const int src = tid % KDA_CHUNK;
        if (src < n) {
            float kk[KDA_CHUNK_PAIRS], qk[KDA_CHUNK_PAIRS];
#pragma unroll
            for (int r = 0; r < KDA_CHUNK_PAIRS; r++) kk[r] = qk[r] = 0.0f;
            for (int i = 0; i < d; i++) {
                const float ks = kc[src * ld + i], gs = gc[src * ld + i];
#pragma unroll
                for (int r = 0; r < KDA_CHUNK_PAIRS; r++) {
                    const int t = tid / KDA_CHUNK + r * (KDA_CHUNK_THREADS / KDA_CHUNK);
                    if (src <= t && t < n) {
                        const float x = ks * expf(gc[t * ld + i] - gs);
                        kk[r] = fmaf(kc[t * ld + i], x, kk[r]);
                        qk[r] = fmaf(qc[t * ld + i], x, qk[r]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < KDA_CHUNK_PAIRS; r++) {
                const int t = tid / KDA_CHUNK + r * (KDA_CHUNK_THREADS / KDA_CHUNK);
                if (src <= t && t < n) {
                    a[t * KDA_CHUNK + src] = src < t ? bc[t] * kk[r] : 0.0f;
                    p[t * KDA_CHUNK + src] = qk[r];
                }
            }
        }
        __syncthreads();
        // Per key channel, so each thread rewrites only the column it reads.
        for (int i = tid; i < d; i += KDA_CHUNK_THREADS) {
            const float gl = gc[(n - 1) * ld + i];
            last_decay[i] = expf(gl);
            for (int t = 0; t < n; t++) {
                const float gt = gc[t * ld + i], k = kc[t * ld + i];
                const float decay = expf(gt);
                q_decayed[t * ld + i] = qc[t * ld + i] * decay;
                k_decayed[t * ld + i] = k * decay;
                k_to_last[t * ld + i] = k * expf(gl - gt);
            }
        }
        __syncthreads();
        float acc[KDA_CHUNK_TOKENS];
#pragma unroll
        for (int r = 0; r < KDA_CHUNK_TOKENS; r++) acc[r] = 0.0f;
        for (int i = 0; i < d; i++) {
            const float x = s[i * KDA_COLS + lane];
#pragma unroll
            for (int r = 0; r < KDA_CHUNK_TOKENS; r++)
                if (r < mine)
                    acc[r] = fmaf(k_decayed[(warp + KDA_CHUNK_WARPS * r) * ld + i], x, acc[r]);
        }
#pragma unroll
        for (int r = 0; r < KDA_CHUNK_TOKENS; r++) {
            if (r < mine) {
                const int t = warp + KDA_CHUNK_WARPS * r;
                const float v =
                    active ? mixed[(i64)(t0 + t) * 3 * c + 2 * c + (i64)head * d + j] : 0.0f;
                u[t * KDA_COLS + lane] = (v - acc[r]) * bc[t];
            }
        }
        __syncthreads();
        // Each lane solves its own column, so one warp and no barrier between rows.
        if (warp == 0) {
            for (int t = 1; t < n; t++) {
                float x = u[t * KDA_COLS + lane];
                for (int src = 0; src < t; src++)
                    x = fmaf(-a[t * KDA_CHUNK + src], u[src * KDA_COLS + lane], x);
                u[t * KDA_COLS + lane] = x;
            }
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < KDA_CHUNK_TOKENS; r++) acc[r] = 0.0f;
        for (int i = 0; i < d; i++) {
            const float x = s[i * KDA_COLS + lane];
#pragma unroll
            for (int r = 0; r < KDA_CHUNK_TOKENS; r++)
                if (r < mine)
                    acc[r] = fmaf(q_decayed[(warp + KDA_CHUNK_WARPS * r) * ld + i], x, acc[r]);
        }
#pragma unroll
        for (int r = 0; r < KDA_CHUNK_TOKENS; r++) {
            if (r < mine) {
                const int t = warp + KDA_CHUNK_WARPS * r;
                float o = acc[r];
                for (int src = 0; src <= t; src++)
                    o = fmaf(p[t * KDA_CHUNK + src], u[src * KDA_COLS + lane], o);
                if (active) out[(i64)(t0 + t) * c + (i64)head * d + j] = o;
            }
        }
        __syncthreads();
        for (int i = warp; i < d; i += KDA_CHUNK_WARPS) {
            float x = last_decay[i] * s[i * KDA_COLS + lane];
            for (int src = 0; src < n; src++)
                x = fmaf(k_to_last[src * ld + i], u[src * KDA_COLS + lane], x);
            s[i * KDA_COLS + lane] = x;
        }
    }
    // Each thread stores the rows it updated last.
    if (active)
        for (int i = warp; i < d; i += KDA_CHUNK_WARPS)
            sg[(i64)i * d + j] = s[i * KDA_COLS + lane];
}

// kda.rs `forget_gate` on g = f_b(f_a(x)) in place ([tokens, channels]), and beta =
// sigmoid(b) in place ([tokens, heads]). With a bound: g = bound * sigmoid(exp(a_log[h]) *
// (g + dt_bias)); without: g = -exp(a_log[h]) * softplus(g + dt_bias) (softplus linear above
// 20). Grid y over tokens.
extern "C" __global__ void kda_gates(float* __restrict__ g, const float* __restrict__ dt_bias,
                                     const float* __restrict__ a_log, int head_dim,
                                     int channels, int has_bound, float bound,
                                     float* __restrict__ beta, int heads) {
    grid_wait();
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

// KDA's conv input per token: the q, k and v projections (`[tokens, width]` each) side by
// side, `[tokens, 3 * width]` (q | k | v), the layout kda_conv reads.
extern "C" __global__ void interleave3(const float* __restrict__ a, const float* __restrict__ b,
                                       const float* __restrict__ c, int tokens, int width,
                                       float* __restrict__ out) {
    grid_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)tokens * width) return;
    const i64 t = i / width, k = i % width;
    float* row = out + t * 3 * width;
    row[k] = a[i];
    row[width + k] = b[i];
    row[2 * width + k] = c[i];
}
