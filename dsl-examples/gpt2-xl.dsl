# GPT-2 XL (1.56B): 48 layers, 25 heads of 64, d = 1600, vocabulary 50257,
# context 1024, output projection tied to the token embedding.
# Parameter names follow Hugging Face's GPT-2 checkpoint layout.
#
# Its step needs about 46 GiB of device memory at B = 8, T = 1024, and 105
# GiB at B = 32, more than an 80 GB GPU has: give it a memory budget
# (`--memory-budget 70GiB`, or `memory_budget = 70` in the train section)
# and fusec recomputes activations in the backward pass until it fits.

const vocab = 50257
const ctx = 1024
const d = 1600
const n_heads = 25
const layers = 48

dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]

block attn(x) {
    param c_attn_w: [d, 3 * d] = normal(0.02)
    param c_attn_b: [3 * d] = zeros
    # Residual projections are scaled by 1/sqrt(2 * layers), as in GPT-2.
    param c_proj_w: [d, d] = normal(0.02 / sqrt(2 * layers))
    param c_proj_b: [d] = zeros
    let q, k, v = split(linear(x, c_attn_w, c_attn_b), 3)
    let y = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads), causal = true)
    return linear(merge_heads(y), c_proj_w, c_proj_b)
}

block mlp(x) {
    param c_fc_w: [d, 4 * d] = normal(0.02)
    param c_fc_b: [4 * d] = zeros
    param c_proj_w: [4 * d, d] = normal(0.02 / sqrt(2 * layers))
    param c_proj_b: [d] = zeros
    return linear(gelu(linear(x, c_fc_w, c_fc_b)), c_proj_w, c_proj_b)
}

block h(x) {
    param ln_1_w: [d] = ones
    param ln_1_b: [d] = zeros
    param ln_2_w: [d] = ones
    param ln_2_b: [d] = zeros
    let x = x + attn(layernorm(x, ln_1_w, ln_1_b))
    return x + mlp(layernorm(x, ln_2_w, ln_2_b))
}

param wte: [vocab, d] = normal(0.02)
param wpe: [ctx, d] = normal(0.01)
param ln_f_w: [d] = ones
param ln_f_b: [d] = zeros

let x = embedding(wte, tokens) + wpe[0:T]
let x = repeat layers h(x)
let logits = layernorm(x, ln_f_w, ln_f_b) @ transpose(wte)

train {
    loss = cross_entropy(logits, targets)
    optimizer = adamw(lr = 6e-4, betas = (0.9, 0.95), eps = 1e-8, weight_decay = 0.1)
    clip_grad_norm = 1.0
    precision = bf16
}
