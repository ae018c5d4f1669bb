// The fused routed-expert step over (expert slot, picks) groups. A slot holds one expert
// record: gate [inter, hidden], up [inter, hidden], down [hidden, inter], each in the
// record's format, at byte offsets 0, up_off, down_off from the slot's base.
//
// Picks are numbered p = t * k + j (token t, pick j); `pick_list` lists each group's picks
// (group g owns pick_list[group_start[g] .. group_start[g] + group_len[g]]).
#include "common.cuh"

// Rows a warp of moe_gate_up's q4_k rows (each a gate row and its up row); the host's grid reads
// the same knob. A tuning knob (GLMFLASH_KERNEL_DEFINES): 1 or 2.
#ifndef GATE_UP_ROWS
#define GATE_UP_ROWS 1
#endif
#if GATE_UP_ROWS != 1 && GATE_UP_ROWS != 2
#error "GATE_UP_ROWS: 1 or 2 (the values the host's grid follows)"
#endif

// Stages of the q4_k rows' loads through shared memory in moe_gate_up and moe_down without WIDE
// (q4_k_lane32_rows_async); 0: none (q4_k_lane32_rows). A tuning knob (GLMFLASH_KERNEL_DEFINES).
#ifndef MOE_Q4K_STAGES
#define MOE_Q4K_STAGES 0
#endif

// Whether the q4_k rows read x (and moe_down's act) in lane-of-32 order (1, after the host's
// `lane32_x`), or in order (0; the host then permutes nothing), and the blocks an SM the
// kernels' registers are bounded for. Tuning knobs (GLMFLASH_KERNEL_DEFINES); the host reads
// MOE_XL too. Session 44 (H100, issue 17's step and moe-speed): the lane-of-32 order was ~5%
// slower for the MoE kernels (the x loads' L1 lines were not their limit), so it is off; six
// blocks an SM was ~8% faster than no bound.
#ifndef MOE_XL
#define MOE_XL 0
#endif
#ifndef MOE_MIN_BLOCKS
#define MOE_MIN_BLOCKS 6
#endif
// Threads of a moe_gate_up / moe_down block: the host's ROW_BLOCK.
#define MOE_ROW_THREADS 128

// q4_k_lane32_rows, or with MOE_Q4K_STAGES its ring (one a kernel, declared here); x (a token's
// row, or a pick's activations) in lane-of-32 order with MOE_XL (lane32_x), else in order.
template <int R>
__device__ __forceinline__ void moe_q4k_rows(const u8* const* w, int blocks,
                                             const float* __restrict__ x, float* acc) {
    if constexpr (MOE_Q4K_STAGES > 0) {
        static_assert(MOE_Q4K_STAGES * R * 2 * MOE_ROW_THREADS * 16 <= 48 * 1024,
                      "MOE_Q4K_STAGES x rows: the ring is static shared memory, at most 48 KiB");
        __shared__ uint4 ring[MOE_Q4K_STAGES * R * 2 * MOE_ROW_THREADS];
        q4_k_lane32_rows_async<1, R, MOE_Q4K_STAGES, MOE_ROW_THREADS, (MOE_XL != 0)>(
            w, blocks, x, 0, 1, acc, ring);
    } else {
        q4_k_lane32_rows<1, R, (MOE_XL != 0)>(w, blocks, x, 0, 1, acc);
    }
}

// gate_up_rows<FMT_Q4_K, false> P gate rows and their up rows a warp (rows P i .. P i + P - 1 for
// warp i), a pick at a time: the 2 P rows share each x value a lane loads, and each row's sum
// takes its products in the order of the row alone (the same bits).
template <int P>
__device__ void gate_up_q4k_rows(const u8* __restrict__ arena, const i64* __restrict__ group_base,
                                 const int* __restrict__ group_start,
                                 const int* __restrict__ group_len,
                                 const int* __restrict__ pick_list, const int* __restrict__ count,
                                 i64 up_off, int inter, int hidden, int k, float limit,
                                 const float* __restrict__ x, float* __restrict__ act,
                                 int act_xl) {
    const int warps = blockDim.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int r0 = P * (blockIdx.x * warps + threadIdx.x / WARP);
    const int g = blockIdx.y;
    if (r0 >= inter || g >= *count) return;
    const i64 rb = row_bytes(FMT_Q4_K, hidden);
    const u8* gate = arena + group_base[g];
    const u8* rows[2 * P];  // gate row r0 + i, then its up row
#pragma unroll
    for (int i = 0; i < P; i++) {
        rows[2 * i] = gate + (i64)min(r0 + i, inter - 1) * rb;
        rows[2 * i + 1] = rows[2 * i] + up_off;
    }
    const int start = group_start[g], len = group_len[g];
    for (int e = 0; e < len; e++) {
        const int p = pick_list[start + e];
        float acc[2 * P];
#pragma unroll
        for (int i = 0; i < 2 * P; i++) acc[i] = 0.0f;
        moe_q4k_rows<2 * P>(rows, hidden / 256, x + (i64)(p / k) * hidden, acc);
#pragma unroll
        for (int i = 0; i < P; i++) {
            const float gv = warp_sum(acc[2 * i]), uv = warp_sum(acc[2 * i + 1]);
            if (lane == 0 && r0 + i < inter)
                act[(i64)p * inter + (act_xl ? lane32_x_pos(r0 + i) : r0 + i)] =
                    silu(fminf(gv, limit)) * fminf(fmaxf(uv, -limit), limit);
        }
    }
}

// WIDE: x holds the group's token rows gathered in entry order (`moe_gather`), so a tile of
// TOK_TILE picks is one strided block and each weight row is read once a tile, not once a
// pick; act is then written by entry. Else each pick's row is its own dot (a tile of one: a
// warp keeps one pair of accumulators and reduces only what it computed; decode's groups are
// of one pick). Each pick's sums see the same products in the same order either way: the
// same bits. q4_k without WIDE: gate_up_q4k_rows<GATE_UP_ROWS>.
template <int FMT, bool WIDE>
__device__ void gate_up_rows(const u8* __restrict__ arena, const i64* __restrict__ group_base,
                             const int* __restrict__ group_start, const int* __restrict__ group_len,
                             const int* __restrict__ pick_list, const int* __restrict__ count,
                             i64 up_off, int inter, int hidden,
                             int k, float limit, const float* __restrict__ x,
                             float* __restrict__ act, int act_xl) {
    if constexpr (!WIDE && FMT == FMT_Q4_K) {
        gate_up_q4k_rows<GATE_UP_ROWS>(arena, group_base, group_start, group_len, pick_list,
                                       count, up_off, inter, hidden, k, limit, x, act, act_xl);
        return;
    }
    const int warps = blockDim.x / WARP;
    const int r = blockIdx.x * warps + threadIdx.x / WARP;
    const int g = blockIdx.y;
    if (r >= inter || g >= *count) return;
    constexpr int TILE = WIDE ? TOK_TILE : 1;
    const i64 rb = row_bytes(FMT, hidden);
    const u8* gate = arena + group_base[g] + (i64)r * rb;
    const u8* up = arena + group_base[g] + up_off + (i64)r * rb;
    const int start = group_start[g], len = group_len[g];
    for (int p0 = 0; p0 < len; p0 += TILE) {
        const int nt = min(TILE, len - p0);
        // Gather this tile's token rows by pointer: tokens of one group are not contiguous.
        float ga[TILE], ua[TILE];
#pragma unroll
        for (int t = 0; t < TILE; t++) ga[t] = ua[t] = 0.0f;
        if (WIDE) {
            const float* xt = x + (i64)(start + p0) * hidden;
            row_dots<FMT>(gate, hidden, xt, hidden, nt, ga);
            row_dots<FMT>(up, hidden, xt, hidden, nt, ua);
        }
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            if (!WIDE && t < nt) {
                const int p = pick_list[start + p0 + t];
                const float* xt = x + (i64)(p / k) * hidden;
                float a1[1] = {0.0f}, a2[1] = {0.0f};
                row_dots<FMT, 1>(gate, hidden, xt, 0, 1, a1);
                row_dots<FMT, 1>(up, hidden, xt, 0, 1, a2);
                ga[t] = a1[0];
                ua[t] = a2[0];
            }
        }
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            const float gv = warp_sum(ga[t]);
            const float uv = warp_sum(ua[t]);
            if (t < nt && (threadIdx.x & (WARP - 1)) == 0) {
                const int at = WIDE ? start + p0 + t : pick_list[start + p0 + t];
                act[(i64)at * inter + (act_xl ? lane32_x_pos(r) : r)] =
                    silu(fminf(gv, limit)) * fminf(fmaxf(uv, -limit), limit);
            }
        }
    }
}

// Rows a warp of moe_down's q4_k rows; the host's grid reads the same knob. A tuning knob
// (GLMFLASH_KERNEL_DEFINES): 1, 2 or 4.
#ifndef DOWN_ROWS
#define DOWN_ROWS 2
#endif
#if DOWN_ROWS != 1 && DOWN_ROWS != 2 && DOWN_ROWS != 4
#error "DOWN_ROWS: 1, 2 or 4 (the values the host's grid follows)"
#endif

// down_rows<FMT_Q4_K, false> R rows a warp (rows R i .. R i + R - 1 for warp i), a pick at a
// time: a q4_k row of an expert's intermediate width is only a few super-blocks (1,152 bytes at
// 2,048), too little for a warp to keep the memory busy; the rows share each act value a lane
// loads, and each row's sum takes its products in the order of the row alone (the same bits).
template <int R>
__device__ void down_q4k_rows(const u8* __restrict__ arena, const i64* __restrict__ group_base,
                              const int* __restrict__ group_start,
                              const int* __restrict__ group_len,
                              const int* __restrict__ pick_list, const int* __restrict__ count,
                              i64 down_off, int hidden, int inter,
                              const float* __restrict__ act, float* __restrict__ yp) {
    const int warps = blockDim.x / WARP, lane = threadIdx.x & (WARP - 1);
    const int r0 = R * (blockIdx.x * warps + threadIdx.x / WARP);
    const int g = blockIdx.y;
    if (r0 >= hidden || g >= *count) return;
    const i64 rb = row_bytes(FMT_Q4_K, inter);
    const u8* down = arena + group_base[g] + down_off;
    const u8* rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) rows[r] = down + (i64)min(r0 + r, hidden - 1) * rb;
    const int start = group_start[g], len = group_len[g];
    for (int e = 0; e < len; e++) {
        const int p = pick_list[start + e];
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0.0f;
        moe_q4k_rows<R>(rows, inter / 256, act + (i64)p * inter, acc);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float v = warp_sum(acc[r]);
            if (lane == 0 && r0 + r < hidden) yp[(i64)p * hidden + r0 + r] = v;
        }
    }
}

// WIDE: act holds the picks' activations by entry (gate_up_rows<FMT, true>). q4_k without
// WIDE: down_q4k_rows<DOWN_ROWS>.
template <int FMT, bool WIDE>
__device__ void down_rows(const u8* __restrict__ arena, const i64* __restrict__ group_base,
                          const int* __restrict__ group_start, const int* __restrict__ group_len,
                          const int* __restrict__ pick_list, const int* __restrict__ count,
                          i64 down_off, int hidden, int inter,
                          const float* __restrict__ act, float* __restrict__ yp) {
    if constexpr (!WIDE && FMT == FMT_Q4_K) {
        down_q4k_rows<DOWN_ROWS>(arena, group_base, group_start, group_len, pick_list, count,
                                 down_off, hidden, inter, act, yp);
        return;
    }
    const int warps = blockDim.x / WARP;
    const int r = blockIdx.x * warps + threadIdx.x / WARP;
    const int g = blockIdx.y;
    if (r >= hidden || g >= *count) return;
    constexpr int TILE = WIDE ? TOK_TILE : 1;
    const i64 rb = row_bytes(FMT, inter);
    const u8* down = arena + group_base[g] + down_off + (i64)r * rb;
    const int start = group_start[g], len = group_len[g];
    for (int p0 = 0; p0 < len; p0 += TILE) {
        const int nt = min(TILE, len - p0);
        float acc[TILE];
#pragma unroll
        for (int t = 0; t < TILE; t++) acc[t] = 0.0f;
        if (WIDE) row_dots<FMT>(down, inter, act + (i64)(start + p0) * inter, inter, nt, acc);
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            if (!WIDE && t < nt) {
                const int p = pick_list[start + p0 + t];
                float a[1] = {0.0f};
                row_dots<FMT, 1>(down, inter, act + (i64)p * inter, 0, 1, a);
                acc[t] = a[0];
            }
        }
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            const float v = warp_sum(acc[t]);
            if (t < nt && (threadIdx.x & (WARP - 1)) == 0) {
                const int p = pick_list[start + p0 + t];
                yp[(i64)p * hidden + r] = v;
            }
        }
    }
}

// act[p, :] = silu(min(gate x_t, L)) * clamp(up x_t, -L, L) for every pick p of every group
// (`*count` groups: the tables `moe_group` writes, or the host's); with act_xl, each row of act
// in lane-of-32 order (lane32_x: for moe_down's q4_k rows under MOE_XL). x: for q4_k under
// MOE_XL, in lane-of-32 order.
// Grid: (ceil(inter / warps per block), room for the groups); for q4_k, ceil(inter /
// GATE_UP_ROWS) warps. Six blocks an SM: ptxas would take ~120 registers (four) for x's loads
// issued ahead, without spilling at 80.
extern "C" __global__ void __launch_bounds__(MOE_ROW_THREADS, MOE_MIN_BLOCKS) moe_gate_up(
    const u8* __restrict__ arena, int fmt, const i64* __restrict__ group_base,
    const int* __restrict__ group_start, const int* __restrict__ group_len,
    const int* __restrict__ pick_list, const int* __restrict__ count, i64 up_off, int inter,
    int hidden, int k, float limit, const float* __restrict__ x, float* __restrict__ act,
    int act_xl) {
    grid_wait();
#define CALL(F)                                                                              \
    gate_up_rows<F, false>(arena, group_base, group_start, group_len, pick_list, count, up_off, \
                           inter, hidden, k, limit, x, act, act_xl)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// moe_gate_up over token rows gathered in entry order (moe_gather), act written by entry.
extern "C" __global__ void moe_gate_up_wide(const u8* __restrict__ arena, int fmt,
                                            const i64* __restrict__ group_base,
                                            const int* __restrict__ group_start,
                                            const int* __restrict__ group_len,
                                            const int* __restrict__ pick_list,
                                            const int* __restrict__ count, i64 up_off, int inter,
                                            int hidden, int k, float limit,
                                            const float* __restrict__ xg, float* __restrict__ act) {
    grid_wait();
#define CALL(F)                                                                              \
    gate_up_rows<F, true>(arena, group_base, group_start, group_len, pick_list, count, up_off, \
                          inter, hidden, k, limit, xg, act, 0)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// yp[p, :] = down act[p, :] (for q4_k under MOE_XL, act in lane-of-32 order). Grid:
// (ceil(hidden / warps per block), room for the groups); for q4_k, ceil(hidden / DOWN_ROWS)
// warps. Six blocks an SM (MOE_MIN_BLOCKS), as moe_gate_up.
extern "C" __global__ void __launch_bounds__(MOE_ROW_THREADS, MOE_MIN_BLOCKS) moe_down(
    const u8* __restrict__ arena, int fmt, const i64* __restrict__ group_base,
    const int* __restrict__ group_start, const int* __restrict__ group_len,
    const int* __restrict__ pick_list, const int* __restrict__ count, i64 down_off, int hidden,
    int inter, const float* __restrict__ act, float* __restrict__ yp) {
    grid_wait();
#define CALL(F)                                                                                \
    down_rows<F, false>(arena, group_base, group_start, group_len, pick_list, count, down_off, \
                        hidden, inter, act, yp)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// moe_down over activations by entry (moe_gate_up_wide).
extern "C" __global__ void moe_down_wide(const u8* __restrict__ arena, int fmt,
                                         const i64* __restrict__ group_base,
                                         const int* __restrict__ group_start,
                                         const int* __restrict__ group_len,
                                         const int* __restrict__ pick_list,
                                         const int* __restrict__ count, i64 down_off, int hidden,
                                         int inter, const float* __restrict__ act,
                                         float* __restrict__ yp) {
    grid_wait();
#define CALL(F)                                                                                \
    down_rows<F, true>(arena, group_base, group_start, group_len, pick_list, count, down_off, \
                       hidden, inter, act, yp)
    DISPATCH_FORMAT(fmt, CALL)
#undef CALL
}

// yp[list[e], :] = y[e, :] for `entries` rows of y (a group's outputs, computed by cuBLAS,
// back to their picks' rows). A block per entry.
extern "C" __global__ void moe_scatter(const float* __restrict__ y, const int* __restrict__ list,
                                       int hidden, float* __restrict__ yp) {
    grid_wait();
    const float* src = y + (i64)blockIdx.x * hidden;
    float* dst = yp + (i64)list[blockIdx.x] * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = src[c];
}

// xg[e, :] = x[rows[e], :] for the entries of a step's groups (their token rows, Table::Rows),
// for the _wide kernels. A block per entry (grid x: a prompt chunk's entries pass grid y's
// 65,535).
extern "C" __global__ void moe_gather(const float* __restrict__ x, const int* __restrict__ rows,
                                      int hidden, float* __restrict__ xg) {
    grid_wait();
    const float* src = x + (i64)rows[blockIdx.x] * hidden;
    float* dst = xg + (i64)blockIdx.x * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = src[c];
}

// out[t, h] = sum over j = 0..k-1, in that order, of w[t, j] * yp[t * k + j, h].
extern "C" __global__ void moe_combine(const float* __restrict__ yp, const float* __restrict__ w,
                                       int tokens, int k, int hidden, float* __restrict__ out) {
    grid_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)tokens * hidden) return;
    const i64 t = i / hidden, h = i % hidden;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) acc += w[t * k + j] * yp[(t * k + j) * hidden + h];
    out[i] = acc;
}

// ---- Grouping on the device: the router's picks never come to the host.
// The layout of the tables `moe_group` writes for `picks` picks and `cap` groups at most
// (node-server/src/backend/cuda/exl3.rs `GroupTables` reads the same): int64 `longs` =
// group_base[cap], entry_base[picks]; int32 `ints` = start[cap], len[cap], rows[picks],
// list[picks], count[1] (the groups).
#define MOE_GROUP_MAX 256

// Groups picks `ids[0 .. picks)` (expert ids of `tokens * k` picks) by their slot
// `slot_of[id]` as the host does: groups in order of first appearance, each group's picks in
// pick order. An id outside `0 .. experts` counts as expert 0 (the router writes none; ids from
// elsewhere may). One block of MOE_GROUP_MAX threads; picks <= MOE_GROUP_MAX.
extern "C" __global__ void moe_group(const int* __restrict__ ids, const int* __restrict__ slot_of,
                                     int experts, int picks, int k, i64 slot_bytes, int cap,
                                     i64* __restrict__ longs, int* __restrict__ ints) {
    grid_wait();
    __shared__ int slot[MOE_GROUP_MAX], first[MOE_GROUP_MAX], glen[MOE_GROUP_MAX],
        gstart[MOE_GROUP_MAX];
    const int i = threadIdx.x;
    int* start = ints;
    int* len = start + cap;
    int* rows = len + cap;
    int* list = rows + picks;
    int* count = list + picks;
    if (i < picks) {
        const int e = ids[i];
        slot[i] = slot_of[(e >= 0 && e < experts) ? e : 0];
    }
    __syncthreads();
    int rank = 0;
    if (i < picks) {
        int f = i;
        for (int j = 0; j < i; j++)
            if (slot[j] == slot[i]) {
                if (f == i) f = j;
                rank++;
            }
        first[i] = f;
    }
    __syncthreads();
    const bool leads = i < picks && first[i] == i;
    if (leads) {
        int n = 0;
        for (int j = i; j < picks; j++) n += slot[j] == slot[i];
        glen[i] = n;
    }
    __syncthreads();
    if (leads) {
        int g = 0, s = 0;
        for (int j = 0; j < i; j++)
            if (first[j] == j) {
                g++;
                s += glen[j];
            }
        gstart[i] = s;
        start[g] = s;
        len[g] = glen[i];
        longs[g] = (i64)slot[i] * slot_bytes;
    }
    __syncthreads();
    if (i < picks) {
        const int at = gstart[first[i]] + rank;
        list[at] = i;
        rows[at] = i / k;
        longs[cap + at] = (i64)slot[i] * slot_bytes;
    }
    if (i == 0) {
        int groups = 0;
        for (int j = 0; j < picks; j++) groups += first[j] == j;
        *count = groups;
    }
}
