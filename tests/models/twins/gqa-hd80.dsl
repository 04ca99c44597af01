# LLaMA-style, head dim 80 with 8 query heads per key/value head, a
# vocabulary of 5003 and an MLP width of 1713; bf16, AdamW, clipping.
const vocab = 5003
const n_heads = 8
const n_kv_heads = 1
const head_dim = 80
const d = n_heads * head_dim
const ffn = 1713

dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]

block layer(x) {
    param attn_norm: [d] = ones
    param wq: [d, n_heads * head_dim] = normal(0.02)
    param wk: [d, n_kv_heads * head_dim] = normal(0.02)
    param wv: [d, n_kv_heads * head_dim] = normal(0.02)
    param wo: [n_heads * head_dim, d] = normal(0.02)
    param ffn_norm: [d] = ones
    param w_gate: [d, ffn] = normal(0.02)
    param w_up: [d, ffn] = normal(0.02)
    param w_down: [ffn, d] = normal(0.02)
    let h = rmsnorm(x, attn_norm, eps = 1e-5)
    let q = rope(heads(h @ wq, n_heads), theta = 500000)
    let k = rope(heads(h @ wk, n_kv_heads), theta = 500000)
    let v = heads(h @ wv, n_kv_heads)
    let x = x + merge_heads(attention(q, k, v, causal = true)) @ wo
    let m = rmsnorm(x, ffn_norm)
    return x + swiglu(m @ w_gate, m @ w_up) @ w_down
}

param emb: [vocab, d] = normal(0.02)
param norm: [d] = ones
param head: [d, vocab] = normal(0.02)
let x = repeat 2 layer(embedding(emb, tokens))
train {
    loss = cross_entropy(rmsnorm(x, norm) @ head, targets)
    optimizer = adamw(lr = 3e-4, betas = (0.9, 0.95), weight_decay = 0.1)
    clip_grad_norm = 1.0
    precision = bf16
}
