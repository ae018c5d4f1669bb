// The fused routed-expert step over (expert slot, picks) groups. A slot holds one expert
// record: gate [inter, hidden], up [inter, hidden], down [hidden, inter], each in the
// record's format, at byte offsets 0, up_off, down_off from the slot's base.
//
// Picks are numbered p = t * k + j (token t, pick j); `pick_list` lists each group's picks
// (group g owns pick_list[group_start[g] .. group_start[g] + group_len[g]]).
#include "common.cuh"

template <int FMT>
__device__ void gate_up_rows(const u8* __restrict__ arena, const i64* __restrict__ group_base,
                             const int* __restrict__ group_start, const int* __restrict__ group_len,
                             const int* __restrict__ pick_list, i64 up_off, int inter, int hidden,
                             int k, float limit, const float* __restrict__ x,
                             float* __restrict__ act) {
    const int warps = blockDim.x / WARP;
    const int r = blockIdx.x * warps + threadIdx.x / WARP;
    const int g = blockIdx.y;
    if (r >= inter) return;
    const i64 rb = row_bytes(FMT, hidden);
    const u8* gate = arena + group_base[g] + (i64)r * rb;
    const u8* up = arena + group_base[g] + up_off + (i64)r * rb;
    const int start = group_start[g], len = group_len[g];
    for (int p0 = 0; p0 < len; p0 += TOK_TILE) {
        const int nt = min(TOK_TILE, len - p0);
        // Gather this tile's token rows by pointer: tokens of one group are not contiguous.
        float ga[TOK_TILE], ua[TOK_TILE];
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) ga[t] = ua[t] = 0.0f;
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) {
            if (t < nt) {
                const int p = pick_list[start + p0 + t];
                const float* xt = x + (i64)(p / k) * hidden;
                float a1[TOK_TILE] = {0.0f}, a2[TOK_TILE] = {0.0f};
                row_dots<FMT>(gate, hidden, xt, 0, 1, a1);
                row_dots<FMT>(up, hidden, xt, 0, 1, a2);
                ga[t] = a1[0];
                ua[t] = a2[0];
            }
        }
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) {
            const float gv = warp_sum(ga[t]);
            const float uv = warp_sum(ua[t]);
            if (t < nt && (threadIdx.x & (WARP - 1)) == 0) {
                const int p = pick_list[start + p0 + t];
                act[(i64)p * inter + r] = silu(fminf(gv, limit)) * fminf(fmaxf(uv, -limit), limit);
            }
        }
    }
}

template <int FMT>
__device__ void down_rows(const u8* __restrict__ arena, const i64* __restrict__ group_base,
                          const int* __restrict__ group_start, const int* __restrict__ group_len,
                          const int* __restrict__ pick_list, i64 down_off, int hidden, int inter,
                          const float* __restrict__ act, float* __restrict__ yp) {
    const int warps = blockDim.x / WARP;
    const int r = blockIdx.x * warps + threadIdx.x / WARP;
    const int g = blockIdx.y;
    if (r >= hidden) return;
    const i64 rb = row_bytes(FMT, inter);
    const u8* down = arena + group_base[g] + down_off + (i64)r * rb;
    const int start = group_start[g], len = group_len[g];
    for (int p0 = 0; p0 < len; p0 += TOK_TILE) {
        const int nt = min(TOK_TILE, len - p0);
        float acc[TOK_TILE];
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) acc[t] = 0.0f;
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) {
            if (t < nt) {
                const int p = pick_list[start + p0 + t];
                float a[TOK_TILE] = {0.0f};
                row_dots<FMT>(down, inter, act + (i64)p * inter, 0, 1, a);
                acc[t] = a[0];
            }
        }
#pragma unroll
        for (int t = 0; t < TOK_TILE; t++) {
            const float v = warp_sum(acc[t]);
            if (t < nt && (threadIdx.x & (WARP - 1)) == 0) {
                const int p = pick_list[start + p0 + t];
                yp[(i64)p * hidden + r] = v;
            }
        }
    }
}

// act[p, :] = silu(min(gate x_t, L)) * clamp(up x_t, -L, L) for every pick p of every group.
// Grid: (ceil(inter / warps per block), groups).
extern "C" __global__ void moe_gate_up(const u8* __restrict__ arena, int fmt,
                                       const i64* __restrict__ group_base,
                                       const int* __restrict__ group_start,
                                       const int* __restrict__ group_len,
                                       const int* __restrict__ pick_list, i64 up_off, int inter,
                                       int hidden, int k, float limit, const float* __restrict__ x,
                                       float* __restrict__ act) {
#define CALL(F)                                                                              \
    gate_up_rows<F>(arena, group_base, group_start, group_len, pick_list, up_off, inter, hidden, \
                    k, limit, x, act)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// yp[p, :] = down act[p, :]. Grid: (ceil(hidden / warps per block), groups).
extern "C" __global__ void moe_down(const u8* __restrict__ arena, int fmt,
                                    const i64* __restrict__ group_base,
                                    const int* __restrict__ group_start,
                                    const int* __restrict__ group_len,
                                    const int* __restrict__ pick_list, i64 down_off, int hidden,
                                    int inter, const float* __restrict__ act,
                                    float* __restrict__ yp) {
#define CALL(F)                                                                                \
    down_rows<F>(arena, group_base, group_start, group_len, pick_list, down_off, hidden, inter, \
                 act, yp)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// out[t, h] = sum over j = 0..k-1, in that order, of w[t, j] * yp[t * k + j, h].
extern "C" __global__ void moe_combine(const float* __restrict__ yp, const float* __restrict__ w,
                                       int tokens, int k, int hidden, float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)tokens * hidden) return;
    const i64 t = i / hidden, h = i % hidden;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) acc += w[t * k + j] * yp[(t * k + j) * hidden + h];
    out[i] = acc;
}
