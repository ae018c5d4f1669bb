// The MoE router after its logits: sigmoid scores, choice by score + correction bias within
// the best `topk_groups` of `groups` expert groups (a group's score is the sum of its two
// best), the top `k`, weights from the scores (normalised if asked) times `scale`. Ties go to
// the lower index, as on the CPU. One block per token; experts <= 1024.
#include "common.cuh"

#define MAX_EXPERTS 1024

// True when (a, ia) ranks before (b, ib): larger value first, then lower index.
__device__ __forceinline__ bool before(float a, int ia, float b, int ib) {
    return a > b || (a == b && ia < ib);
}

extern "C" __global__ void route(const float* __restrict__ logits, const float* __restrict__ bias,
                                 int experts, int groups, int topk_groups, int k, int normalize,
                                 float scale, int* __restrict__ ids, float* __restrict__ weights) {
    __shared__ float score[MAX_EXPERTS];
    __shared__ float choice[MAX_EXPERTS];
    __shared__ float gscore[MAX_EXPERTS];
    __shared__ int keep[MAX_EXPERTS];
    const int t = blockIdx.x;
    // A pick no expert ranks for (scores all NaN) stays -1.
    for (int j = threadIdx.x; j < k; j += blockDim.x) ids[(i64)t * k + j] = -1;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float s = sigmoid(logits[(i64)t * experts + e]);
        score[e] = s;
        choice[e] = s + bias[e];
    }
    __syncthreads();
    const int per = experts / groups;
    if (groups > 1) {
        // Each group's score: its two best choices.
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            int b0 = -1, b1 = -1;
            for (int e = g * per; e < (g + 1) * per; e++) {
                if (b0 < 0 || before(choice[e], e, choice[b0], b0)) {
                    b1 = b0;
                    b0 = e;
                } else if (b1 < 0 || before(choice[e], e, choice[b1], b1)) {
                    b1 = e;
                }
            }
            gscore[g] = choice[b0] + choice[b1];
        }
        __syncthreads();
        // A group is kept when fewer than topk_groups groups rank before it (written to
        // `keep`, not `gscore`, which other threads are still reading).
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            int rank = 0;
            for (int h = 0; h < groups; h++) rank += before(gscore[h], h, gscore[g], g);
            keep[g] = rank < topk_groups;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < experts; e += blockDim.x)
            if (!keep[e / per]) choice[e] = __int_as_float(0xff800000);
        __syncthreads();
    }
    // Rank of every expert by choice; the ones ranked < k are the picks, in rank order.
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int rank = 0;
        const float c = choice[e];
        for (int f = 0; f < experts && rank < k; f++) rank += before(choice[f], f, c, e);
        if (rank < k) ids[(i64)t * k + rank] = e;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float denom = 0.0f;
        for (int j = 0; j < k; j++) denom += score[ids[(i64)t * k + j]];
        denom += 1e-20f;
        for (int j = 0; j < k; j++) {
            float v = score[ids[(i64)t * k + j]];
            if (normalize) v /= denom;
            weights[(i64)t * k + j] = v * scale;
        }
    }
}
