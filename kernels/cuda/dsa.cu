// The DSA indexer with k-pools: pool keys from their tokens' keys and gates, a query's score
// of every visible pool, and the top pools expanded to tokens (plus the incomplete tail
// pool). The scores repeat the CPU's arithmetic operation for operation (no fused
// multiply-adds, the same summation order), so the selection is the CPU's exactly; ties go
// to the earlier pool, as `ops::top_k` does under `f32::total_cmp`.
#include "common.cuh"

#define TOPK_THREADS 256

// Channel c of the key of pool `pool` from keys and gates ([tokens, di] in format fmt,
// cache_load) and ape ([kpool, di]): a softmax over the pool's tokens of gate + ape weights
// their keys, in the CPU's order of operations.
__device__ float pool_key_channel(const u8* __restrict__ keys, const u8* __restrict__ gates,
                                  int fmt, const float* __restrict__ ape, int di, int kpool,
                                  i64 pool, int c) {
    const i64 tok0 = pool * kpool;
    float m = __int_as_float(0xff800000);
    for (int j = 0; j < kpool; j++)
        m = fmaxf(m, __fadd_rn(cache_load(gates, (tok0 + j) * di + c, fmt), ape[(i64)j * di + c]));
    float sum = 0.0f;
    for (int j = 0; j < kpool; j++) {
        const float l = __fadd_rn(cache_load(gates, (tok0 + j) * di + c, fmt), ape[(i64)j * di + c]);
        sum = __fadd_rn(sum, expf(__fsub_rn(l, m)));
    }
    float key = -0.0f;
    for (int j = 0; j < kpool; j++) {
        const float l = __fadd_rn(cache_load(gates, (tok0 + j) * di + c, fmt), ape[(i64)j * di + c]);
        const float w = __fdiv_rn(expf(__fsub_rn(l, m)), sum);
        key = __fadd_rn(key, __fmul_rn(w, cache_load(keys, (tok0 + j) * di + c, fmt)));
    }
    return key;
}

// out: [pools, di], the keys of pools first_pool .. first_pool + pools. One thread per
// (pool, channel).
extern "C" __global__ void dsa_pool_keys(const u8* __restrict__ keys,
                                         const u8* __restrict__ gates, int fmt,
                                         const float* __restrict__ ape, int di, int kpool,
                                         int first_pool, int pools, float* __restrict__ out) {
    grid_wait();
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (i64)pools * di) return;
    const int p = (int)(t / di), c = (int)(t % di);
    out[t] = pool_key_channel(keys, gates, fmt, ape, di, kpool, first_pool + p, c);
}

// A decode graph's pool step: the keys hold tokens0 + *step tokens after this step's push; when
// that completes a pool, its key is stored (in format fmt) as row `pool` of pool_keys, the
// bits dsa_pool_keys then cache_store give. One thread per channel.
extern "C" __global__ void dsa_pool_step(const u8* __restrict__ keys,
                                         const u8* __restrict__ gates, int fmt,
                                         const float* __restrict__ ape, int di, int kpool,
                                         i64 tokens0, const int* __restrict__ step,
                                         u8* __restrict__ pool_keys) {
    grid_wait();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const i64 tokens = tokens0 + *step;
    if (c >= di || tokens % kpool != 0) return;
    const i64 pool = tokens / kpool - 1;
    cache_put(pool_keys, pool * di + c, fmt, pool_key_channel(keys, gates, fmt, ape, di, kpool, pool, c));
}

// A decode graph's selection plan for `queries` consecutive queries, the first seeing
// vis0 + *step tokens: per query its candidate pools, visible tokens and first output place
// (out_off), and the attention's offsets (sel_off, queries + 1), as dsa_select_dev works them
// out on the host. One thread.
extern "C" __global__ void dsa_plan(i64 vis0, const int* __restrict__ step, int queries,
                                    int kpool, int budget_pools, int select_tail,
                                    int* __restrict__ candidates, int* __restrict__ visible,
                                    i64* __restrict__ out_off, int* __restrict__ sel_off) {
    grid_wait();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    i64 off = 0;
    for (int b = 0; b < queries; b++) {
        const i64 vis = vis0 + *step + b;
        const int cand = (int)(vis / kpool);
        const int tail = select_tail ? (int)(vis % kpool) : 0;
        candidates[b] = cand;
        visible[b] = (int)vis;
        out_off[b] = off;
        sel_off[b] = (int)off;
        off += (i64)min(budget_pools, cand) * kpool + tail;
    }
    sel_off[queries] = (int)off;
}

// `ops::dot` exactly: eight strided partial sums, summed in order, plus the tail; b is the n
// cache values from b0 on, in format fmt.
__device__ float cpu_dot(const float* __restrict__ a, const u8* __restrict__ cache, i64 b0,
                         int fmt, int n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int chunks = n / 8;
    for (int ch = 0; ch < chunks; ch++) {
#pragma unroll
        for (int l = 0; l < 8; l++)
            acc[l] = __fadd_rn(acc[l], __fmul_rn(a[ch * 8 + l], cache_load(cache, b0 + ch * 8 + l, fmt)));
    }
    float s = -0.0f;
#pragma unroll
    for (int l = 0; l < 8; l++) s = __fadd_rn(s, acc[l]);
    float tail = -0.0f;
    for (int i = chunks * 8; i < n; i++)
        tail = __fadd_rn(tail, __fmul_rn(a[i], cache_load(cache, b0 + i, fmt)));
    return __fadd_rn(s, tail);
}

// q: [queries, heads, di]; w: [queries, heads]; pool_keys: [pools, di] in format keys_fmt;
// candidates: [queries], how many leading pools query b scores. scores: [queries, max_cand].
// One warp per (pool, query): lane h computes head h's term, the terms are summed in head
// order.
extern "C" __global__ void dsa_scores(const float* __restrict__ q, const float* __restrict__ w,
                                      const u8* __restrict__ pool_keys, int keys_fmt,
                                      const int* __restrict__ candidates, int heads, int di,
                                      float scale, int max_cand, float* __restrict__ scores) {
    grid_wait();
    const int warps = blockDim.x / WARP;
    const int p = blockIdx.x * warps + threadIdx.x / WARP;
    const int b = blockIdx.y;
    const int lane = threadIdx.x & (WARP - 1);
    if (p >= candidates[b]) return;  // uniform across the warp
    const i64 key = (i64)p * di;
    const float* qb = q + (i64)b * heads * di;
    const float* wb = w + (i64)b * heads;
    float total = -0.0f;
    for (int h0 = 0; h0 < heads; h0 += WARP) {
        const int h = h0 + lane;
        float term = 0.0f;
        if (h < heads) {
            const float x = __fmul_rn(cpu_dot(qb + (i64)h * di, pool_keys, key, keys_fmt, di), scale);
            term = __fmul_rn(wb[h], x > 0.0f ? x : 0.0f);
        }
        const int n = min(WARP, heads - h0);
        for (int l = 0; l < n; l++) total = __fadd_rn(total, __shfl_sync(0xffffffffu, term, l));
    }
    if (lane == 0) scores[(i64)b * max_cand + p] = total;
}

// f32 bits mapped so unsigned order is `f32::total_cmp` order.
__device__ __forceinline__ u32 total_order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u >> 31) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of `v` over the block in thread order; `*total` gets the block's sum.
// Every thread must call it.
__device__ u32 block_exclusive_scan(u32 v, u32* total) {
    __shared__ u32 warp_sums[32];
    const int lane = threadIdx.x & (WARP - 1), wid = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    u32 inc = v;
    for (int o = 1; o < WARP; o <<= 1) {
        const u32 up = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += up;
    }
    if (lane == WARP - 1) warp_sums[wid] = inc;
    __syncthreads();
    u32 before = 0, all = 0;
    for (int k = 0; k < warps; k++) {
        if (k < wid) before += warp_sums[k];
        all += warp_sums[k];
    }
    __syncthreads();
    *total = all;
    return before + inc - v;
}

// One block per query (TOPK_THREADS threads). Keeps the best min(budget_pools, candidates[b])
// of scores[b, 0 .. candidates[b]] (larger first, ties to the lower pool), and writes their
// tokens ascending at tokens[out_off[b] ..], then, when select_tail, the incomplete tail
// pool's tokens (visible[b] % kpool of them, up to visible[b]). A query with no more pools
// than the budget keeps them all (no selection: what it would keep). The radix select's bins
// are searched by a warp (a lane 8 of them), not one thread (256 in a row a pass: ~18 us a
// call in session 41's profile).
extern "C" __global__ void dsa_topk_tokens(const float* __restrict__ scores,
                                           const int* __restrict__ candidates,
                                           const int* __restrict__ visible,
                                           const i64* __restrict__ out_off, int max_cand,
                                           int budget_pools, int kpool, int select_tail,
                                           u32* __restrict__ tokens) {
    grid_wait();
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_remaining;
    const int b = blockIdx.x, tid = threadIdx.x;
    const int cand = candidates[b];
    const int budget = min(budget_pools, cand);
    const float* sc = scores + (i64)b * max_cand;
    u32* out = tokens + out_off[b];

    if (budget > 0 && budget == cand) {
        for (int i = tid; i < cand * kpool; i += blockDim.x) out[i] = (u32)i;
    } else if (budget > 0) {
        // Radix select of the budget-th largest key, 8 bits at a time from the top:
        // afterwards every key above `s_prefix` is kept, and the first `s_remaining` keys
        // equal to it (in pool order).
        if (tid == 0) {
            s_prefix = 0;
            s_remaining = (u32)budget;
        }
        u32 mask = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
            __syncthreads();
            const u32 prefix = s_prefix;
            for (int p = tid; p < cand; p += blockDim.x) {
                const u32 k = total_order_key(sc[p]);
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            // The largest digit d whose keys and those above reach s_remaining: lane l holds
            // bins 255 - 8 l down to 248 - 8 l, the keys above its bins an exclusive scan over
            // the lanes; the first lane with a hit has the largest d.
            if (tid < WARP) {
                const u32 rem = s_remaining;
                u32 h8[8], mine = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    h8[i] = hist[255 - 8 * tid - i];
                    mine += h8[i];
                }
                u32 incl = mine;
#pragma unroll
                for (int o = 1; o < WARP; o <<= 1) {
                    const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (tid >= o) incl += v;
                }
                u32 above = incl - mine, hit_above = 0;
                int hit = -1;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if (hit < 0 && above + h8[i] >= rem) {
                        hit = i;
                        hit_above = above;
                    }
                    above += h8[i];
                }
                const u32 lanes = __ballot_sync(0xffffffffu, hit >= 0);
                if (lanes != 0 && tid == __ffs(lanes) - 1) {
                    s_prefix = prefix | ((u32)(255 - 8 * tid - hit) << shift);
                    s_remaining = rem - hit_above;
                }
            }
            __syncthreads();
            mask |= 255u << shift;
        }
        const u32 threshold = s_prefix, take_equal = s_remaining;

        // Compaction in pool order: the kept pools' ranks give their output places.
        u32 equal_seen = 0, kept_seen = 0;
        for (int base = 0; base < cand; base += blockDim.x) {
            const int p = base + tid;
            const u32 k = p < cand ? total_order_key(sc[p]) : 0u;
            const u32 above = p < cand && k > threshold;
            const u32 equal = p < cand && k == threshold;
            u32 equal_total, kept_total;
            const u32 equal_rank = block_exclusive_scan(equal, &equal_total);
            const u32 kept = above || (equal && equal_seen + equal_rank < take_equal);
            const u32 place = kept_seen + block_exclusive_scan(kept, &kept_total);
            if (kept)
                for (int j = 0; j < kpool; j++)
                    out[(i64)place * kpool + j] = (u32)((i64)p * kpool + j);
            equal_seen += equal_total;
            kept_seen += kept_total;
        }
    }
    if (select_tail) {
        const int vis = visible[b], tail = vis % kpool;
        for (int t = tid; t < tail; t += blockDim.x)
            out[(i64)budget * kpool + t] = (u32)(vis - tail + t);
    }
}
