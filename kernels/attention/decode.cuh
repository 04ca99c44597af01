// fusec attention for decoding: the few query rows of a decode step
// against a key/value cache, each row seeing the keys at positions 0 to its
// own (causal). Made for one query row a head: no tiles to fill, so the
// work is split over the keys instead.
//
// One block a (batch entry, query row, cache head, chunk of that head's
// query heads): grouped-query heads that share a cache head read its keys
// and values once for up to HEADS of them. The block's warps take every
// warps-th key; a warp's lanes hold features lane, lane + 32, ... (FEATS
// each), so a key's row is read by one coalesced warp load and its score
// is a warp sum. Each warp keeps an online softmax per query head (running
// max and sum, accumulators rescaled when the max grows), UNROLL keys in
// flight at once, scored together and folded in with one rescale; the
// warps' partial results then merge through shared memory. Scores use
// exp2 with log2(e) folded into the scale.
//
// Shapes: q [B, S, Hq, D], k cache [B, C, Hkv, D], v cache [B, C, Hkv, Dv],
// o [B, S, Hq, Dv], positions [S] (int); query head h reads cache head
// h / group. D and Dv at most 32 * FEATS; at most WARPS warps a block. E
// is the element type (fs_el::Bf16, F16 or F32); all arithmetic is f32.
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_ATTENTION_DECODE
#define FS_ATTENTION_DECODE

#include "../elements.cuh"

namespace fs_attn_decode {

// A [B, T, H, D] view: (b, i, h, e) at p[b * sb + i * st + h * sh + e * se].
template <class P>
struct View {
    P* p;
    fs_i64 sb, st, sh, se;
    __device__ __forceinline__ fs_i64 row(fs_i64 b, fs_i64 i, fs_i64 h) const { return b * sb + i * st + h * sh; }
};

struct Sizes {
    fs_i64 batch, q_len, cache_len, q_heads, kv_heads, group, head_dim, v_dim;
    float scale;           // of q.k
    const int* positions;  // [q_len]: row i sees keys 0 ..= positions[i]
};

template <class E, int FEATS, int HEADS, int WARPS, int UNROLL>
__device__ __forceinline__ void forward(const View<const typename E::Storage>& q,
                                        const View<const typename E::Storage>& k,
                                        const View<const typename E::Storage>& v,
                                        const View<typename E::Storage>& o, const Sizes& s) {
    // A warp's lanes: FS_WARP, 32 on the GPU and 1 on the host (tests),
    // where one thread holds all of a head's features.
    constexpr int LANE_FEATS = FEATS * 32 / FS_WARP;
    const float neg_inf = -__int_as_float(0x7f800000);
    const float log2e = 1.4426950408889634f;
    __shared__ float part_max[WARPS][HEADS], part_sum[WARPS][HEADS];
    __shared__ float part_acc[WARPS][HEADS][32 * FEATS];
    const int warp = threadIdx.x / FS_WARP, lane = threadIdx.x % FS_WARP;
    const int warps = (int)blockDim.x / FS_WARP;  // at most WARPS
    const fs_i64 chunks = (s.group + HEADS - 1) / HEADS;
    const fs_i64 rows = s.batch * s.q_len * s.kv_heads * chunks;
    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const fs_i64 chunk = row % chunks, hk = row / chunks % s.kv_heads, i = row / (chunks * s.kv_heads) % s.q_len,
                     b = row / (chunks * s.kv_heads * s.q_len);
        const fs_i64 h0 = hk * s.group + chunk * HEADS;
        const fs_i64 left = s.group - chunk * HEADS;
        const int heads = left < HEADS ? (int)left : HEADS;
        const fs_i64 pos = s.positions[i];
        const fs_i64 keys = pos < 0 ? 0 : (pos + 1 < s.cache_len ? pos + 1 : s.cache_len);
        // This lane's features of each query head, scaled for exp2.
        float qr[HEADS][LANE_FEATS];
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
#pragma unroll
            for (int f = 0; f < LANE_FEATS; ++f) {
                const fs_i64 e = lane + FS_WARP * f;
                qr[h][f] = (h < heads && e < s.head_dim)
                               ? E::load(&q.p[q.row(b, i, h0 + h) + e * q.se]) * s.scale * log2e
                               : 0.0f;
            }
        }
        float mx[HEADS], sum[HEADS], acc[HEADS][LANE_FEATS];
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
            mx[h] = neg_inf;
            sum[h] = 0.0f;
#pragma unroll
            for (int f = 0; f < LANE_FEATS; ++f) acc[h][f] = 0.0f;
        }
        const fs_i64 k_head = k.row(b, 0, hk), v_head = v.row(b, 0, hk);
        for (fs_i64 j0 = warp; j0 < keys; j0 += (fs_i64)warps * UNROLL) {
            // UNROLL keys' rows loaded before any is used.
            float kr[UNROLL][LANE_FEATS], vr[UNROLL][LANE_FEATS];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const fs_i64 j = j0 + (fs_i64)u * warps;
#pragma unroll
                for (int f = 0; f < LANE_FEATS; ++f) {
                    const fs_i64 e = lane + FS_WARP * f;
                    kr[u][f] = (j < keys && e < s.head_dim) ? E::load(&k.p[k_head + j * k.st + e * k.se]) : 0.0f;
                    vr[u][f] = (j < keys && e < s.v_dim) ? E::load(&v.p[v_head + j * v.st + e * v.se]) : 0.0f;
                }
            }
            // Every key's score first (their warp sums are independent, so
            // their shuffles overlap), then one rescale for all of them.
#pragma unroll
            for (int h = 0; h < HEADS; ++h) {
                float score[UNROLL];
                float new_max = mx[h];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    float dot = 0.0f;
#pragma unroll
                    for (int f = 0; f < LANE_FEATS; ++f) dot += qr[h][f] * kr[u][f];
                    const float sc = fs_warp_sum(dot);  // the whole warp, every key
                    score[u] = j0 + (fs_i64)u * warps < keys ? sc : neg_inf;
                    new_max = fmaxf(new_max, score[u]);
                }
                // A key past the last scores -inf: p = 0 (new_max is finite:
                // the warp's first key j0 < keys is among them).
                const float rescale = exp2f(mx[h] - new_max);
                mx[h] = new_max;
                sum[h] *= rescale;
#pragma unroll
                for (int f = 0; f < LANE_FEATS; ++f) acc[h][f] *= rescale;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const float p = exp2f(score[u] - new_max);
                    sum[h] += p;
#pragma unroll
                    for (int f = 0; f < LANE_FEATS; ++f) acc[h][f] += p * vr[u][f];
                }
            }
        }
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
            if (lane == 0) {
                part_max[warp][h] = mx[h];
                part_sum[warp][h] = sum[h];
            }
#pragma unroll
            for (int f = 0; f < LANE_FEATS; ++f) part_acc[warp][h][lane + FS_WARP * f] = acc[h][f];
        }
        __syncthreads();
        // Each thread an output feature of a head: the warps' parts,
        // rescaled to the largest max among them.
        for (fs_i64 t = threadIdx.x; t < (fs_i64)heads * s.v_dim; t += blockDim.x) {
            const int h = (int)(t / s.v_dim);
            const int e = (int)(t % s.v_dim);
            float top = neg_inf;
            for (int w = 0; w < warps; ++w) top = fmaxf(top, part_max[w][h]);
            float total = 0.0f, out = 0.0f;
            if (top != neg_inf) {
                for (int w = 0; w < warps; ++w) {
                    const float r = exp2f(part_max[w][h] - top);
                    total += part_sum[w][h] * r;
                    out += part_acc[w][h][e] * r;
                }
            }
            o.p[o.row(b, i, h0 + h) + e * o.se] = E::store(total > 0.0f ? out / total : 0.0f);
        }
        __syncthreads();
    }
}

}  // namespace fs_attn_decode

#endif
