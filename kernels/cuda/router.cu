// The MoE router after its logits: sigmoid scores, choice by score + correction bias within
// the best `topk_groups` of `groups` expert groups (a group's score is the sum of its two
// best), the top `k`, weights from the scores (normalised if asked) times `scale`. The order
// is the CPU's (`ops::rank_key`): larger first by f32 total order, ties to the lower index (a
// NaN ranks by its sign, which the two devices' sigmoids need not give alike). One block of
// ROUTE_THREADS per token; experts <= 1024. A pick is the block's smallest key, k times over:
// a few microseconds, where ranking every expert against all others took ~25 (session 41).
#include "common.cuh"

#define MAX_EXPERTS 1024
// Threads of a block: the host's block size.
#define ROUTE_THREADS 256
#define ROUTE_KEYS (MAX_EXPERTS / ROUTE_THREADS)

typedef unsigned long long u64;

// A key whose ascending order is `v` descending by total order, then `i` ascending: the CPU's
// `ops::rank_key`.
__device__ __forceinline__ u64 rank_key(float v, int i) {
    const u32 bits = __float_as_uint(v);
    const u32 ordered = (bits >> 31) ? ~bits : (bits | 0x80000000u);
    return ((u64)(~ordered) << 32) | (u32)i;
}

__device__ __forceinline__ u64 warp_min_u64(u64 v) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

extern "C" __global__ void route(const float* __restrict__ logits, const float* __restrict__ bias,
                                 int experts, int groups, int topk_groups, int k, int normalize,
                                 float scale, int* __restrict__ ids, float* __restrict__ weights) {
    grid_wait();
    __shared__ float score[MAX_EXPERTS];
    __shared__ float choice[MAX_EXPERTS];
    __shared__ u64 gkey[MAX_EXPERTS];
    __shared__ int keep[MAX_EXPERTS];
    __shared__ int pick[MAX_EXPERTS];
    __shared__ u64 wmin[ROUTE_THREADS / WARP];
    const int t = blockIdx.x, lane = threadIdx.x & (WARP - 1), warp = threadIdx.x / WARP;
    for (int e = threadIdx.x; e < experts; e += ROUTE_THREADS) {
        const float s = sigmoid(logits[(i64)t * experts + e]);
        score[e] = s;
        choice[e] = s + bias[e];
    }
    __syncthreads();
    const int per = experts / groups;
    if (groups > 1) {
        // Each group's score: the sum of its two best choices (its one, for groups of one).
        for (int g = threadIdx.x; g < groups; g += ROUTE_THREADS) {
            u64 b0 = ~0ull, b1 = ~0ull;
            for (int e = g * per; e < (g + 1) * per; e++) {
                const u64 c = rank_key(choice[e], e);
                if (c < b0) {
                    b1 = b0;
                    b0 = c;
                } else if (c < b1) {
                    b1 = c;
                }
            }
            const float s = per > 1 ? choice[(u32)b0] + choice[(u32)b1] : choice[(u32)b0];
            gkey[g] = rank_key(s, g);
        }
        __syncthreads();
        // A group is kept when fewer than topk_groups groups rank before it.
        for (int g = threadIdx.x; g < groups; g += ROUTE_THREADS) {
            int rank = 0;
            for (int h = 0; h < groups; h++) rank += gkey[h] < gkey[g];
            keep[g] = rank < topk_groups;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < experts; e += ROUTE_THREADS)
            if (!keep[e / per]) choice[e] = __int_as_float(0xff800000);
        __syncthreads();
    }
    // The picks one after another: the block's smallest key, then its owner drops it.
    u64 key[ROUTE_KEYS];
#pragma unroll
    for (int i = 0; i < ROUTE_KEYS; i++) {
        const int e = threadIdx.x + i * ROUTE_THREADS;
        key[i] = e < experts ? rank_key(choice[e], e) : ~0ull;
    }
    for (int j = 0; j < k; j++) {
        u64 m = key[0];
#pragma unroll
        for (int i = 1; i < ROUTE_KEYS; i++) m = key[i] < m ? key[i] : m;
        m = warp_min_u64(m);
        if (lane == 0) wmin[warp] = m;
        __syncthreads();
        m = wmin[0];
#pragma unroll
        for (int w = 1; w < ROUTE_THREADS / WARP; w++) m = wmin[w] < m ? wmin[w] : m;
#pragma unroll
        for (int i = 0; i < ROUTE_KEYS; i++)
            if (key[i] == m) key[i] = ~0ull;
        if (threadIdx.x == 0) pick[j] = (int)(u32)m;
        // wmin is rewritten by the next pick.
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float denom = 0.0f;
        for (int j = 0; j < k; j++) denom += score[pick[j]];
        denom += 1e-20f;
        for (int j = 0; j < k; j++) {
            float v = score[pick[j]];
            if (normalize) v /= denom;
            ids[(i64)t * k + j] = pick[j];
            weights[(i64)t * k + j] = v * scale;
        }
    }
}
