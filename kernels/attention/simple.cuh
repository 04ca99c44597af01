// fusec attention, the simple exact kernels: forward and backward for what
// the tensor-core templates do not take (head dims that are not multiples
// of 8 or are over 256, rows that are not contiguous and 16-byte aligned,
// an f32 backward past 256 features in D + Dv; and FUSEC_ATTENTION=simple).
//
// One block a query row (and, in the backward, a block a key row); keys (or
// queries) stream by in chunks of blockDim.x: each thread scores one entry
// of the chunk, the chunk's weights go to shared memory, then every thread
// accumulates the output features it owns. Accumulators live in registers,
// FEATS features a thread a pass; a head wider than FEATS * blockDim.x
// takes more passes (each recomputes the scores), so any head size works
// with any block size up to BLOCK, including the host shim's one thread.
// No score matrix is ever stored; the backward is deterministic (no
// atomics).
//
// Shapes: q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], o and dO
// [B, T, Hq, Dv], lse [B, Hq, T] (f32); query head h reads key/value head
// h / group. E is the element type of every tensor but lse (fs_el::Bf16,
// F16 or F32; all arithmetic is f32).
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_ATTENTION_SIMPLE
#define FS_ATTENTION_SIMPLE

#include "../elements.cuh"
#include "../random/philox.cuh"

namespace fs_attn_simple {

// Output features each thread accumulates a pass (a register array).
#define FS_ATTN_SIMPLE_FEATS 4

// A [B, T, H, D] view: (b, i, h, e) at p[b * sb + i * st + h * sh + e * se].
// Inputs are often strided slices of one fused projection; a packed
// gradient's dQ, dK and dV are views of one output.
template <class E>
struct In {
    const typename E::Storage* p;
    fs_i64 sb, st, sh, se;
    __device__ __forceinline__ fs_i64 row(fs_i64 b, fs_i64 i, fs_i64 h) const { return b * sb + i * st + h * sh; }
    __device__ __forceinline__ float at(fs_i64 row, fs_i64 e) const { return E::load(&p[row + e * se]); }
};
template <class E>
struct Out {
    typename E::Storage* p;
    fs_i64 sb, st, sh, se;
    __device__ __forceinline__ fs_i64 row(fs_i64 b, fs_i64 i, fs_i64 h) const { return b * sb + i * st + h * sh; }
    __device__ __forceinline__ void set(fs_i64 row, fs_i64 e, float x) const { p[row + e * se] = E::store(x); }
};
// The log-sum-exp [B, H, T]: (b, h, i) at p[b * sb + h * sh + i * st].
template <class P>
struct Lse {
    P* p;
    fs_i64 sb, sh, st;
    __device__ __forceinline__ P& at(fs_i64 b, fs_i64 h, fs_i64 i) const { return p[b * sb + h * sh + i * st]; }
};

// The sizes and options of one attention op.
struct Sizes {
    fs_i64 batch, q_len, kv_len, q_heads, kv_heads, group, head_dim, v_dim;
    float scale;   // of q.k
    bool causal;   // if so, keys j > query i are masked
    // Each batch entry's number of keys (the rest are padding: no query
    // sees them and their dK, dV rows are zero), or null: kv_len for all.
    const int* kv_lens;
    // Dropout on the probabilities, or a null key: draws below `threshold`
    // (fs_attention_draw's 8 bits for the op's site) dropped, kept ones
    // multiplied by `keep_scale`, 1 over the share kept.
    const int* drop_key;
    unsigned drop_site, drop_threshold;
    float keep_scale;
};

// The keys batch entry b sees.
__device__ __forceinline__ fs_i64 keys_of(const Sizes& s, fs_i64 b) {
    if (!s.kv_lens) return s.kv_len;
    const fs_i64 n = s.kv_lens[b];
    return n < 0 ? 0 : n < s.kv_len ? n : s.kv_len;
}

// The dropout factor of probability (query i, key j) of head row bh: 1
// without dropout.
__device__ __forceinline__ float keep(const Sizes& s, fs_i64 bh, fs_i64 i, fs_i64 j) {
    if (!s.drop_key) return 1.0f;
    return fs_attention_draw(s.drop_key, s.drop_site, bh, i, j) >= s.drop_threshold ? s.keep_scale : 0.0f;
}

// Forward: one block per (batch, query head, query row), rows in lse's
// order. An online softmax (running max and sum, accumulators rescaled
// when the max grows) over chunks of keys; lse = max + log(sum) is kept for
// the backward.
template <class E, int BLOCK>
__device__ __forceinline__ void forward(const In<E>& q, const In<E>& k, const In<E>& v, const Out<E>& o,
                                        const Lse<float>& lse, const Sizes& s) {
    constexpr int FEATS = FS_ATTN_SIMPLE_FEATS;
    const float neg_inf = -__int_as_float(0x7f800000);
    __shared__ float probs[BLOCK];
    const fs_i64 rows = s.batch * s.q_heads * s.q_len;
    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const fs_i64 i = row % s.q_len, h = (row / s.q_len) % s.q_heads, b = row / (s.q_len * s.q_heads);
        const fs_i64 q_row = q.row(b, i, h), k_head = k.row(b, 0, h / s.group), v_head = v.row(b, 0, h / s.group);
        // Causal: chunks past the diagonal are never visited.
        const fs_i64 own = keys_of(s, b), keys = (s.causal && i + 1 < own) ? i + 1 : own;
        for (fs_i64 d0 = 0; d0 < s.v_dim; d0 += FEATS * (fs_i64)blockDim.x) {
            float acc[FEATS] = {};
            float row_max = neg_inf, row_sum = 0.0f;
            for (fs_i64 j0 = 0; j0 < keys; j0 += blockDim.x) {
                const fs_i64 j = j0 + threadIdx.x;
                float score = neg_inf;
                if (j < keys) {
                    const fs_i64 k_row = k_head + j * k.st;
                    float dot = 0.0f;
                    for (fs_i64 d = 0; d < s.head_dim; ++d) dot += q.at(q_row, d) * k.at(k_row, d);
                    score = dot * s.scale;
                }
                // Every visited chunk holds a visible key: new_max is finite.
                const float new_max = fmaxf(row_max, fs_block_max(score));
                const float p = expf(score - new_max), rescale = expf(row_max - new_max);
                row_sum = row_sum * rescale + fs_block_sum(p);
                row_max = new_max;
                __syncthreads();  // the last chunk's readers are done with probs
                probs[threadIdx.x] = j < keys ? p * keep(s, b * s.q_heads + h, i, j) : 0.0f;
                __syncthreads();
                const fs_i64 chunk = keys - j0 < blockDim.x ? keys - j0 : blockDim.x;
#pragma unroll
                for (int r = 0; r < FEATS; ++r) acc[r] *= rescale;
                for (fs_i64 jj = 0; jj < chunk; ++jj) {
                    const float pj = probs[jj];
                    const fs_i64 v_row = v_head + (j0 + jj) * v.st;
#pragma unroll
                    for (int r = 0; r < FEATS; ++r) {
                        const fs_i64 d = d0 + threadIdx.x + (fs_i64)r * blockDim.x;
                        if (d < s.v_dim) acc[r] += pj * v.at(v_row, d);
                    }
                }
            }
            // No visible key (kv_len = 0): output 0, lse -inf, no NaN.
            const float inv_sum = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
            const fs_i64 o_row = o.row(b, i, h);
#pragma unroll
            for (int r = 0; r < FEATS; ++r) {
                const fs_i64 d = d0 + threadIdx.x + (fs_i64)r * blockDim.x;
                if (d < s.v_dim) o.set(o_row, d, acc[r] * inv_sum);
            }
            if (d0 == 0 && threadIdx.x == 0) lse.at(b, h, i) = row_sum > 0.0f ? row_max + logf(row_sum) : neg_inf;
        }
    }
}

// Backward. Rows below q_rows are query rows (b, h, i) writing
// dq_i = scale * sum_j p_ij (dp_ij - D_i) k_j; the rest are key rows
// (b, kv head, j) writing dv_j = sum p_ij dO_i and
// dk_j = scale * sum p_ij (dp_ij - D_i) q_i over the query heads of the
// group. p_ij = exp(scale q_i.k_j - lse_i), dp_ij = dO_i.v_j, D_i = dO_i.O_i.
// With dropout, P's kept entries are scaled and dropped ones zeroed
// (Z): dS = P (Z dP - D), dV's P Z.
template <class E, int BLOCK>
__device__ __forceinline__ void backward(const In<E>& q, const In<E>& k, const In<E>& v, const In<E>& o,
                                         const Lse<const float>& lse, const In<E>& dout, const Out<E>& dq,
                                         const Out<E>& dk, const Out<E>& dv, const Sizes& s) {
    constexpr int FEATS = FS_ATTN_SIMPLE_FEATS;
    __shared__ float probs[BLOCK], dscores[BLOCK];
    // Query rows first, then key rows.
    const fs_i64 query_rows = s.batch * s.q_heads * s.q_len, rows = query_rows + s.batch * s.kv_heads * s.kv_len;
    for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        if (row < query_rows) {
            const fs_i64 i = row % s.q_len, h = (row / s.q_len) % s.q_heads, b = row / (s.q_len * s.q_heads);
            const fs_i64 q_row = q.row(b, i, h), o_row = o.row(b, i, h), do_row = dout.row(b, i, h);
            const fs_i64 k_head = k.row(b, 0, h / s.group), v_head = v.row(b, 0, h / s.group);
            float part = 0.0f;
            for (fs_i64 d = threadIdx.x; d < s.v_dim; d += blockDim.x) part += dout.at(do_row, d) * o.at(o_row, d);
            const float delta = fs_block_sum(part);
            const float row_lse = lse.at(b, h, i);
            const fs_i64 own = keys_of(s, b), keys = (s.causal && i + 1 < own) ? i + 1 : own;
            for (fs_i64 d0 = 0; d0 < s.head_dim; d0 += FEATS * (fs_i64)blockDim.x) {
                float acc[FEATS] = {};
                for (fs_i64 j0 = 0; j0 < keys; j0 += blockDim.x) {
                    const fs_i64 j = j0 + threadIdx.x;
                    float ds = 0.0f;
                    // One visible key: a constant softmax, dS = 0 exactly (not
                    // dp - delta, two sums of the same terms in different orders).
                    if (j < keys && keys > 1) {
                        const fs_i64 k_row = k_head + j * k.st, v_row = v_head + j * v.st;
                        float qk = 0.0f, dp = 0.0f;
                        for (fs_i64 d = 0; d < s.head_dim; ++d) qk += q.at(q_row, d) * k.at(k_row, d);
                        for (fs_i64 d = 0; d < s.v_dim; ++d) dp += dout.at(do_row, d) * v.at(v_row, d);
                        const float z = keep(s, b * s.q_heads + h, i, j);
                        ds = expf(qk * s.scale - row_lse) * (dp * z - delta) * s.scale;
                    }
                    __syncthreads();  // the last chunk's readers are done
                    dscores[threadIdx.x] = ds;
                    __syncthreads();
                    const fs_i64 chunk = keys - j0 < blockDim.x ? keys - j0 : blockDim.x;
                    for (fs_i64 jj = 0; jj < chunk; ++jj) {
                        const float dsj = dscores[jj];
                        const fs_i64 k_row = k_head + (j0 + jj) * k.st;
#pragma unroll
                        for (int r = 0; r < FEATS; ++r) {
                            const fs_i64 d = d0 + threadIdx.x + (fs_i64)r * blockDim.x;
                            if (d < s.head_dim) acc[r] += dsj * k.at(k_row, d);
                        }
                    }
                }
                const fs_i64 dq_row = dq.row(b, i, h);
#pragma unroll
                for (int r = 0; r < FEATS; ++r) {
                    const fs_i64 d = d0 + threadIdx.x + (fs_i64)r * blockDim.x;
                    if (d < s.head_dim) dq.set(dq_row, d, acc[r]);
                }
            }
        } else {
            const fs_i64 key = row - query_rows;
            const fs_i64 j = key % s.kv_len, kv_h = (key / s.kv_len) % s.kv_heads, b = key / (s.kv_len * s.kv_heads);
            const fs_i64 k_row = k.row(b, j, kv_h), v_row = v.row(b, j, kv_h);
            const fs_i64 entry_keys = keys_of(s, b);
            // Causal: queries before key j do not see it; a padded key no query.
            const fs_i64 first = j >= entry_keys ? s.q_len : s.causal ? j : 0;
            // A key row owns head_dim features of dk and v_dim of dv.
            const fs_i64 feats = s.head_dim > s.v_dim ? s.head_dim : s.v_dim;
            for (fs_i64 d0 = 0; d0 < feats; d0 += FEATS * (fs_i64)blockDim.x) {
                float dk_acc[FEATS] = {}, dv_acc[FEATS] = {};
                for (fs_i64 hh = 0; hh < s.group; ++hh) {
                    const fs_i64 h = kv_h * s.group + hh;
                    const fs_i64 q_head = q.row(b, 0, h), o_head = o.row(b, 0, h), do_head = dout.row(b, 0, h);
                    for (fs_i64 i0 = first; i0 < s.q_len; i0 += blockDim.x) {
                        const fs_i64 i = i0 + threadIdx.x;
                        float p = 0.0f, ds = 0.0f;
                        if (i < s.q_len) {
                            const fs_i64 q_row = q_head + i * q.st, o_row = o_head + i * o.st, do_row = do_head + i * dout.st;
                            float qk = 0.0f, dp = 0.0f, delta = 0.0f;
                            for (fs_i64 d = 0; d < s.head_dim; ++d) qk += q.at(q_row, d) * k.at(k_row, d);
                            for (fs_i64 d = 0; d < s.v_dim; ++d) {
                                const float dout_d = dout.at(do_row, d);
                                dp += dout_d * v.at(v_row, d);
                                delta += dout_d * o.at(o_row, d);
                            }
                            p = expf(qk * s.scale - lse.at(b, h, i));
                            const float z = keep(s, b * s.q_heads + h, i, j);
                            ds = p * (dp * z - delta) * s.scale;
                            p *= z;
                            // A query that sees one key: dS = 0 exactly, as above.
                            if (entry_keys <= 1 || (s.causal && i == 0)) ds = 0.0f;
                        }
                        __syncthreads();  // the last chunk's readers are done
                        probs[threadIdx.x] = p;
                        dscores[threadIdx.x] = ds;
                        __syncthreads();
                        const fs_i64 chunk = s.q_len - i0 < blockDim.x ? s.q_len - i0 : blockDim.x;
                        for (fs_i64 ii = 0; ii < chunk; ++ii) {
                            const float p_i = probs[ii], ds_i = dscores[ii];
                            const fs_i64 q_row = q_head + (i0 + ii) * q.st, do_row = do_head + (i0 + ii) * dout.st;
#pragma unroll
                            for (int r = 0; r < FEATS; ++r) {
                                const fs_i64 d = d0 + threadIdx.x + (fs_i64)r * blockDim.x;
                                if (d < s.v_dim) dv_acc[r] += p_i * dout.at(do_row, d);
                                if (d < s.head_dim) dk_acc[r] += ds_i * q.at(q_row, d);
                            }
                        }
                    }
                }
                const fs_i64 dk_row = dk.row(b, j, kv_h), dv_row = dv.row(b, j, kv_h);
#pragma unroll
                for (int r = 0; r < FEATS; ++r) {
                    const fs_i64 d = d0 + threadIdx.x + (fs_i64)r * blockDim.x;
                    if (d < s.head_dim) dk.set(dk_row, d, dk_acc[r]);
                    if (d < s.v_dim) dv.set(dv_row, d, dv_acc[r]);
                }
            }
        }
    }
}

}  // namespace fs_attn_simple

#endif
