# Head dim 96, non-causal attention with an explicit scale, layernorm with
# its own eps, GELU; fp16 with loss scaling and 3 micro-batches.
const d = 192
const n_heads = 2
const vocab = 97

dim B, T
input tokens: i32[B, T]
input labels: i32[B]

param emb: [vocab, d] = normal(0.02)
param pos: [16, d] = normal(0.01)
param ln_w: [d] = ones
param ln_b: [d] = zeros
param w_qkv: [d, 3 * d] = normal(0.02)
param w_o: [d, d] = normal(0.02)
param w_fc: [d, 4 * d] = normal(0.02)
param b_fc: [4 * d] = zeros
param w_cls: [d, 5] = normal(0.02)

let x = embedding(emb, tokens) + pos[0:T]
let h = layernorm(x, ln_w, ln_b, eps = 1e-6)
let q, k, v = split(h @ w_qkv, 3)
let a = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads), scale = 0.08)
let x = x + merge_heads(a) @ w_o
let x = x + gelu(linear(x, w_fc, b_fc))[:, :, 0:d]
let pooled = mean(x, axis = 1)
train {
    loss = cross_entropy(pooled @ w_cls, labels)
    optimizer = adamw(lr = 1e-3)
    precision = fp16
    micro_batches = 3
}
