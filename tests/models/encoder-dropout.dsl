# A small encoder with dropout where BERT and the Transformer put it: on the
# summed embeddings, on the attention probabilities, on each sublayer's
# output before the residual add, and inside the feed-forward block. Sizes
# are deliberately odd (d 20, FFN 52, vocabulary 37).

const vocab = 37
const ctx = 16
const d = 20
const n_heads = 2
const ffn = 52
const layers = 2
const p = 0.1

dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]

block encoder(x) {
    param qkv_w: [d, 3 * d] = normal(0.02)
    param qkv_b: [3 * d] = zeros
    param out_w: [d, d] = normal(0.02)
    param out_b: [d] = zeros
    param ln1_w: [d] = ones
    param ln1_b: [d] = zeros
    param ff_in_w: [d, ffn] = normal(0.02)
    param ff_in_b: [ffn] = zeros
    param ff_out_w: [ffn, d] = normal(0.02)
    param ff_out_b: [d] = zeros
    param ln2_w: [d] = ones
    param ln2_b: [d] = zeros
    let q, k, v = split(linear(x, qkv_w, qkv_b), 3)
    let a = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads), dropout = p)
    let x = layernorm(x + dropout(linear(merge_heads(a), out_w, out_b), p), ln1_w, ln1_b)
    let f = linear(dropout(gelu(linear(x, ff_in_w, ff_in_b)), p), ff_out_w, ff_out_b)
    return layernorm(x + dropout(f, p), ln2_w, ln2_b)
}

param tok: [vocab, d] = normal(0.02)
param pos: [ctx, d] = normal(0.02)
param head_w: [d, vocab] = normal(0.02)

let x = repeat layers encoder(dropout(embedding(tok, tokens) + pos[0:T], p))
let logits = linear(x, head_w)

train {
    loss = cross_entropy(logits, targets)
    optimizer = adamw(lr = 1e-3, weight_decay = 0.01)
}
