# A 7B-class LLaMA (LLaMA-2 7B's sizes): RMSNorm, rotary position
# embedding, SwiGLU MLP, 32 heads of 128. In mixed precision with AdamW it
# needs 16 bytes a parameter (f32 masters, moments and gradients, bf16
# weights): 108 GB before activations, more than one GPU holds. Train it
# sharded over several GPUs (`--gpus N --zero 2` splits the optimizer
# state, the masters and the gradients; `fusec build ... --gpus N --zero 2`
# says what each GPU holds).

const vocab = 32000
const d = 4096
const n_heads = 32
const n_kv_heads = 32
const head_dim = d / n_heads
const ffn = 11008
const layers = 32

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
