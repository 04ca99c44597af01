# A LLaMA-style decoder with head dim 80 and 8 query heads on each
# key/value head (grouped-query 8:1), the shape of models that do not come
# in powers of two: RMSNorm, rotary embedding, SwiGLU, GQA attention.
# tools/bench_llama.py holds its PyTorch twin for timing beside torch.compile.

const vocab = 32000
const d = 1280
const n_heads = 16
const n_kv_heads = 2
const head_dim = d / n_heads
const ffn = 3456
const layers = 8

dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]

block attention_block(x) {
    param wq: [d, n_heads * head_dim] = normal(0.02)
    param wk: [d, n_kv_heads * head_dim] = normal(0.02)
    param wv: [d, n_kv_heads * head_dim] = normal(0.02)
    param wo: [n_heads * head_dim, d] = normal(0.02 / sqrt(2 * layers))
    let q = rope(heads(x @ wq, n_heads))
    let k = rope(heads(x @ wk, n_kv_heads))
    let v = heads(x @ wv, n_kv_heads)
    return merge_heads(attention(q, k, v, causal = true)) @ wo
}

block feed_forward(x) {
    param w_gate: [d, ffn] = normal(0.02)
    param w_up: [d, ffn] = normal(0.02)
    param w_down: [ffn, d] = normal(0.02 / sqrt(2 * layers))
    return swiglu(x @ w_gate, x @ w_up) @ w_down
}

block layer(x) {
    param attention_norm: [d] = ones
    param ffn_norm: [d] = ones
    let x = x + attention_block(rmsnorm(x, attention_norm))
    return x + feed_forward(rmsnorm(x, ffn_norm))
}

param tok_embeddings: [vocab, d] = normal(0.02)
param norm: [d] = ones
param output: [d, vocab] = normal(0.02)

let x = repeat layers layer(embedding(tok_embeddings, tokens))
let logits = rmsnorm(x, norm) @ output

train {
    loss = cross_entropy(logits, targets)
    optimizer = adamw(lr = 3e-4, betas = (0.9, 0.95), eps = 1e-8, weight_decay = 0.1)
    clip_grad_norm = 1.0
    precision = bf16
}
