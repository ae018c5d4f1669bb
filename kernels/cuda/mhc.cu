// mHC (manifold-constrained hyper-connections): the residual is n streams of d values per
// token. `mhc_collapse` turns a token's projection logits into its pre/post/comb weights
// (sigmoids, a row softmax and Sinkhorn balancing, in the CPU's order of operations) and
// collapses the streams into the sublayer input; `mhc_expand` writes the sublayer output
// back: new stream m = post[m] * y + sum_i comb[i][m] * stream i.
#include "common.cuh"

// Most streams the kernels take (the model uses 4); the host checks.
#define MHC_MAX_N 8
// Columns a `mhc_collapse` thread holds in registers for the norm (4,096 at 256 threads).
#define MHC_HELD 16

// Entry idx (< 32 E) of a warp's E-registers-a-lane array `v` (entry idx in lane idx mod 32,
// register idx / 32). Every lane of the warp must call it.
template <int E>
__device__ __forceinline__ float mhc_entry(const float (&v)[E], int idx) {
    float r = __shfl_sync(0xffffffffu, v[0], idx & (WARP - 1));
    if (E > 1) {
        const float b = __shfl_sync(0xffffffffu, v[E - 1], idx & (WARP - 1));
        if (idx >= WARP) r = b;
    }
    return r;
}

// Weights of one token from its (2 + n) n logits `l`, written to shared `pre`, `post` and
// `comb`. Run by one whole warp (n n <= 32 E): lane q owns comb entries q + 32 e in registers,
// and pre/post[q] for q < n. Every sum still adds its n terms one by one in the CPU's order
// (each lane reads them from their owners by shuffles), and every product, sum and quotient
// is unfused, so the weights equal the one-thread version's; the n n entries of a Sinkhorn
// step run at once, with no block-wide barrier. The caller syncs the block before reading.
// NC: n when known at compile time (the sums' shuffles then issue together), else 0.
template <int E, int NC>
__device__ void mhc_weights(const float* __restrict__ l, const float* __restrict__ base, float s0,
                            float s1, float s2, int n_, float eps, int iters, float* pre,
                            float* post, float* comb) {
    const int n = NC ? NC : n_;
    const int lane = threadIdx.x & (WARP - 1), nn = n * n;
    if (lane < n) {
        pre[lane] = sigmoid(__fadd_rn(__fmul_rn(l[lane], s0), base[lane])) + eps;
        post[lane] = 2.0f * sigmoid(__fadd_rn(__fmul_rn(l[n + lane], s1), base[n + lane]));
    }
    float v[E], nv[E];
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int idx = lane + WARP * e;
        v[e] = idx < nn ? __fadd_rn(__fmul_rn(l[2 * n + idx], s2), base[2 * n + idx]) : 0.0f;
    }
    // Row softmax: every entry of row i computes the row's max and sum itself.
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int idx = lane + WARP * e, i = idx < nn ? idx / n : 0;
        float mx = __int_as_float(0xff800000);  // -inf
#pragma unroll
        for (int c = 0; c < (NC ? NC : n); c++) mx = fmaxf(mx, mhc_entry<E>(v, i * n + c));
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < (NC ? NC : n); c++) sum += expf(mhc_entry<E>(v, i * n + c) - mx);
        nv[e] = expf(v[e] - mx) / sum + eps;
    }
#pragma unroll
    for (int e = 0; e < E; e++) v[e] = nv[e];
    // Sinkhorn: columns once, then (iters - 1) times rows then columns; each sum adds eps.
    for (int it = 0; it < (iters > 1 ? iters : 1); it++) {
        if (it > 0) {
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int idx = lane + WARP * e, i = idx < nn ? idx / n : 0;
                float sum = 0.0f;
#pragma unroll
                for (int c = 0; c < (NC ? NC : n); c++) sum += mhc_entry<E>(v, i * n + c);
                sum += eps;
                nv[e] = v[e] / sum;
            }
#pragma unroll
            for (int e = 0; e < E; e++) v[e] = nv[e];
        }
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int idx = lane + WARP * e, j = idx < nn ? idx % n : 0;
            float sum = 0.0f;
#pragma unroll
            for (int r = 0; r < (NC ? NC : n); r++) sum += mhc_entry<E>(v, r * n + j);
            sum += eps;
            nv[e] = v[e] / sum;
        }
#pragma unroll
        for (int e = 0; e < E; e++) v[e] = nv[e];
    }
#pragma unroll
    for (int e = 0; e < E; e++)
        if (lane + WARP * e < nn) comb[lane + WARP * e] = v[e];
}

// Threads of a `mhc_project` block, the columns it takes (MHC_PROJECT_PER a lane), and the
// logits a token has at most: (2 + MHC_MAX_N) MHC_MAX_N.
#define MHC_PROJECT_THREADS 256
#define MHC_PROJECT_PER 8
#define MHC_PROJECT_COLS (WARP * MHC_PROJECT_PER)
#define MHC_MAX_LOGITS ((2 + MHC_MAX_N) * MHC_MAX_N)

// mHC's projection of each token's RMS-normed streams: logits[t, j] = (proj[j, :] . x[t, :])
// * inv_t with inv_t = 1 / sqrt(mean(x[t, :]^2) + eps) — the norm's one scale a token taken
// out of the dots, so the streams are read once and never copied. proj: [rows, width] of W
// (f32, or bf16 widened exactly: the same sums as f32 rows of the widened values);
// x: [T, width]. Grid (ceil(width / MHC_PROJECT_COLS), T), MHC_PROJECT_THREADS threads: in
// block (c, t) warp w takes rows w, w + 8, ... of columns [c COLS, (c + 1) COLS) (row `rows`
// being x's sum of squares), each lane MHC_PROJECT_PER consecutive columns (16-byte loads where
// width and the pointers allow, else one value at a time: the same products either way) with
// its loads all in flight at once, and writes the dots to part[t, c, 0 .. rows]; the last
// block of token t to finish (tickets[t], left at zero) sums the chunks, a warp a row (lane l
// the chunks l, l + 32, ... in order, then the warp's fixed tree), and writes the logits.
// Results repeat bit for bit.
__device__ __forceinline__ float mhc_weight(const float* w, i64 i) { return w[i]; }
__device__ __forceinline__ float mhc_weight(const u16* w, i64 i) { return bf16_to_f32(w[i]); }

// Values col .. col + 7 of a row (16-byte aligned) as f32.
__device__ __forceinline__ void mhc_weights8(const float* w, i64 col, float v[8]) {
    const float4 a = *(const float4*)(w + col), b = *(const float4*)(w + col + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void mhc_weights8(const u16* w, i64 col, float v[8]) {
    widen16<FMT_BF16>(*(const uint4*)(w + col), v);
}

template <typename W>
__device__ __forceinline__ void mhc_project_rows(const W* __restrict__ proj,
                                                 const float* __restrict__ x, int rows,
                                                 int width, float eps, float* __restrict__ part,
                                                 u32* __restrict__ tickets,
                                                 float* __restrict__ logits) {
    static_assert(MHC_PROJECT_PER == 8, "a lane's columns are one 16-byte load of bf16");
    __shared__ float total[MHC_MAX_LOGITS + 1];
    const int t = blockIdx.y, c = blockIdx.x, chunks = gridDim.x;
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    const int col0 = c * MHC_PROJECT_COLS + lane * MHC_PROJECT_PER;
    const float* xt = x + (i64)t * width;
    // Whole 16-byte loads: every row of x and proj aligned, and this lane's columns inside.
    const bool vec = (width & 7) == 0 &&
                     (((unsigned long long)x | (unsigned long long)proj) & 15) == 0;
    float xv[MHC_PROJECT_PER];
    if (vec && col0 < width) {
        mhc_weights8(xt, col0, xv);
    } else {
#pragma unroll
        for (int i = 0; i < MHC_PROJECT_PER; i++) xv[i] = col0 + i < width ? xt[col0 + i] : 0.0f;
    }
    float* mine = part + ((i64)t * chunks + c) * (rows + 1);
    for (int j = wid; j <= rows; j += MHC_PROJECT_THREADS / WARP) {
        float acc = 0.0f;
        if (j == rows) {
#pragma unroll
            for (int i = 0; i < MHC_PROJECT_PER; i++) acc = fmaf(xv[i], xv[i], acc);
        } else {
            const W* pj = proj + (i64)j * width;
            float p[MHC_PROJECT_PER];
            if (vec && col0 < width) {
                mhc_weights8(pj, col0, p);
            } else {
#pragma unroll
                for (int i = 0; i < MHC_PROJECT_PER; i++)
                    p[i] = col0 + i < width ? mhc_weight(pj, col0 + i) : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < MHC_PROJECT_PER; i++) acc = fmaf(p[i], xv[i], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) mine[j] = acc;
    }
    if (!last_of_group(tickets + t, chunks)) return;
    for (int j = wid; j <= rows; j += MHC_PROJECT_THREADS / WARP) {
        float s = 0.0f;
        for (int k = lane; k < chunks; k += WARP)
            s += __ldcg(part + ((i64)t * chunks + k) * (rows + 1) + j);
        s = warp_sum(s);
        if (lane == 0) total[j] = s;
    }
    __syncthreads();
    const float inv = 1.0f / sqrtf(total[rows] / (float)width + eps);
    for (int j = threadIdx.x; j < rows; j += blockDim.x) logits[(i64)t * rows + j] = total[j] * inv;
}

extern "C" __global__ void __launch_bounds__(MHC_PROJECT_THREADS) mhc_project(
    const float* __restrict__ proj, const float* __restrict__ x, int rows, int width, float eps,
    float* __restrict__ part, u32* __restrict__ tickets, float* __restrict__ logits) {
    grid_wait();
    mhc_project_rows(proj, x, rows, width, eps, part, tickets, logits);
}

// mhc_project over bf16 weights (checkpoints that keep `hc_*_fn` in bf16).
extern "C" __global__ void __launch_bounds__(MHC_PROJECT_THREADS) mhc_project_bf16(
    const u16* __restrict__ proj, const float* __restrict__ x, int rows, int width, float eps,
    float* __restrict__ part, u32* __restrict__ tickets, float* __restrict__ logits) {
    grid_wait();
    mhc_project_rows(proj, x, rows, width, eps, part, tickets, logits);
}

// The pre-weighted sum of a column's n stream values (`s[i d]`), in the CPU's order.
__device__ __forceinline__ float mhc_pre_sum(const float* w_pre, const float* s, int n, int d) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc = __fadd_rn(acc, __fmul_rn(w_pre[i], s[(i64)i * d]));
    return acc;
}

// logits: [T, (2 + n) n]; base: [(2 + n) n]; streams: [T, n, d]. Writes collapsed [T, d],
// post [T, n] and comb [T, n, n] (comb[t][i][m]: weight of input stream i in output m).
// Grid (ceil(d / blockDim.x), T), blockDim.x >= 32: every block derives its token's weights
// itself (a few hundred flops), so one token's collapse spreads over many blocks; block x == 0
// writes post and comb. With `has_norm` the collapsed row is RMS-normed and weighted as
// `rms_norm` does it (the sublayer's input norm, one launch less): every block collapses the
// whole row for its sum of squares (the row's n d values come from L2 after the first block;
// the same sum in every block), then writes its own columns.
extern "C" __global__ void mhc_collapse(const float* __restrict__ logits,
                                        const float* __restrict__ base, float s0, float s1,
                                        float s2, int n, int d, float eps, int iters,
                                        const float* __restrict__ streams, int has_norm,
                                        const float* __restrict__ norm_weight, float norm_eps,
                                        float* __restrict__ collapsed, float* __restrict__ post,
                                        float* __restrict__ comb) {
    grid_wait();
    __shared__ float w_pre[MHC_MAX_N], w_post[MHC_MAX_N], w_comb[MHC_MAX_N * MHC_MAX_N];
    const int t = blockIdx.y;
    const float* l = logits + (i64)t * (2 + n) * n;
    const float* row = streams + (i64)t * n * d;
    // The model's case (4 streams, a row of at most MHC_HELD columns a thread) with the norm:
    // the thread's columns j = this thread, + blockDim.x, ... are loaded before the weights
    // are derived, so their loads are in flight while warp 0 balances (they need no weight).
    const bool held = has_norm && n == 4 && d <= MHC_HELD * (int)blockDim.x;
    float h[MHC_HELD][4];
    if (held) {
#pragma unroll
        for (int m = 0; m < MHC_HELD; m++) {
            const int j = threadIdx.x + m * blockDim.x;
#pragma unroll
            for (int i = 0; i < 4; i++) h[m][i] = j < d ? row[(i64)i * d + j] : 0.0f;
        }
    }
    if (threadIdx.x < WARP) {
        if (n == 4)  // the model's streams
            mhc_weights<1, 4>(l, base, s0, s1, s2, n, eps, iters, w_pre, w_post, w_comb);
        else if (n * n <= WARP)
            mhc_weights<1, 0>(l, base, s0, s1, s2, n, eps, iters, w_pre, w_post, w_comb);
        else
            mhc_weights<2, 0>(l, base, s0, s1, s2, n, eps, iters, w_pre, w_post, w_comb);
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) post[(i64)t * n + i] = w_post[i];
        for (int i = threadIdx.x; i < n * n; i += blockDim.x)
            comb[(i64)t * n * n + i] = w_comb[i];
    }
    if (held) {
        // The same sums in the same order as the loop below and `mhc_pre_sum`.
        float ss = 0.0f, own = 0.0f;
#pragma unroll
        for (int m = 0; m < MHC_HELD; m++) {
            if (threadIdx.x + m * (int)blockDim.x >= d) break;
            float v = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++) v = __fadd_rn(v, __fmul_rn(w_pre[i], h[m][i]));
            ss = fmaf(v, v, ss);
            if (m == (int)blockIdx.x) own = v;
        }
        const float inv = 1.0f / sqrtf(block_sum(ss) / (float)d + norm_eps);
        const int k = blockIdx.x * blockDim.x + threadIdx.x;
        if (k < d) collapsed[(i64)t * d + k] = norm_weight[k] * (own * inv);
        return;
    }
    float inv = 1.0f;
    if (has_norm) {
        float ss = 0.0f;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            const float v = mhc_pre_sum(w_pre, row + j, n, d);
            ss = fmaf(v, v, ss);
        }
        inv = 1.0f / sqrtf(block_sum(ss) / (float)d + norm_eps);
    }
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < d) {
        const float acc = mhc_pre_sum(w_pre, row + k, n, d);
        collapsed[(i64)t * d + k] = has_norm ? norm_weight[k] * (acc * inv) : acc;
    }
}

// post: [T, n]; comb: [T, n, n]; streams: [T, n, d]; y: [T, d]; out: [T, n, d] (may be
// `streams` itself: each thread reads all n values of its column before writing them).
// Grid (ceil(d / blockDim.x), T).
extern "C" __global__ void mhc_expand(const float* post, const float* comb, const float* streams,
                                      const float* y, int n, int d, float* out) {
    grid_wait();
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
