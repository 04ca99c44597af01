# An encoder over padded batches: each sequence's length masks its padded
# keys in every attention, and the loss ignores padded targets (id 0), so
# a batch padded further changes nothing. Head dim 12, an odd vocabulary.

const vocab = 29
const ctx = 16
const d = 24
const n_heads = 2
const layers = 2
const p = 0.0
const pad = 0

dim B, T
input tokens: i32[B, T]
input lengths: i32[B]
input targets: i32[B, T]

block encoder(x, lengths) {
    param qkv_w: [d, 3 * d] = normal(0.2)
    param out_w: [d, d] = normal(0.2)
    param ln_w: [d] = ones
    param ln_b: [d] = zeros
    param ff_w: [d, d] = normal(0.2)
    let q, k, v = split(x @ qkv_w, 3)
    let a = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads), lengths = lengths)
    let x = layernorm(x + dropout(merge_heads(a) @ out_w, p), ln_w, ln_b)
    return x + gelu(x @ ff_w)
}

param tok: [vocab, d] = normal(0.5)
param pos: [ctx, d] = normal(0.5)
param head_w: [d, vocab] = normal(0.2)

let x = repeat layers encoder(embedding(tok, tokens) + pos[0:T], lengths)
let logits = x @ head_w

train {
    loss = cross_entropy(logits, targets, ignore_index = pad)
    optimizer = adamw(lr = 1e-3)
}
