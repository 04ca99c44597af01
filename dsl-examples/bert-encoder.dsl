# A BERT-style encoder (BERT-base sizes): token, position and segment
# embeddings, post-LayerNorm blocks with bidirectional attention, and a
# masked-language-model head tied to the token embedding.

const vocab = 30522
const ctx = 512
const segments = 2
const d = 768
const n_heads = 12
const layers = 12

dim B, T
input tokens: i32[B, T]
input segment_ids: i32[B, T]
input targets: i32[B, T]

block encoder(x) {
    param qkv_w: [d, 3 * d] = normal(0.02)
    param qkv_b: [3 * d] = zeros
    param out_w: [d, d] = normal(0.02)
    param out_b: [d] = zeros
    param ln_attn_w: [d] = ones
    param ln_attn_b: [d] = zeros
    param ff_in_w: [d, 4 * d] = normal(0.02)
    param ff_in_b: [4 * d] = zeros
    param ff_out_w: [4 * d, d] = normal(0.02)
    param ff_out_b: [d] = zeros
    param ln_ff_w: [d] = ones
    param ln_ff_b: [d] = zeros
    let q, k, v = split(linear(x, qkv_w, qkv_b), 3)
    # No causal mask: every token sees the whole sequence.
    let a = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads))
    let x = layernorm(x + linear(merge_heads(a), out_w, out_b), ln_attn_w, ln_attn_b, eps = 1e-12)
    let f = linear(gelu(linear(x, ff_in_w, ff_in_b)), ff_out_w, ff_out_b)
    return layernorm(x + f, ln_ff_w, ln_ff_b, eps = 1e-12)
}

param word_embeddings: [vocab, d] = normal(0.02)
param position_embeddings: [ctx, d] = normal(0.02)
param token_type_embeddings: [segments, d] = normal(0.02)
param emb_ln_w: [d] = ones
param emb_ln_b: [d] = zeros
param mlm_dense_w: [d, d] = normal(0.02)
param mlm_dense_b: [d] = zeros
param mlm_ln_w: [d] = ones
param mlm_ln_b: [d] = zeros
param mlm_bias: [vocab] = zeros

let e = embedding(word_embeddings, tokens) + position_embeddings[0:T] + embedding(token_type_embeddings, segment_ids)
let x = repeat layers encoder(layernorm(e, emb_ln_w, emb_ln_b, eps = 1e-12))
let h = layernorm(gelu(linear(x, mlm_dense_w, mlm_dense_b)), mlm_ln_w, mlm_ln_b, eps = 1e-12)
let logits = h @ transpose(word_embeddings) + mlm_bias

train {
    loss = cross_entropy(logits, targets)
    optimizer = adamw(lr = 1e-4, betas = (0.9, 0.999), eps = 1e-6, weight_decay = 0.01)
    clip_grad_norm = 1.0
    precision = bf16
}
