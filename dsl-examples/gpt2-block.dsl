# One GPT-2 small transformer block (pre-LayerNorm, causal self-attention,
# GELU MLP), trained to map its input to a target: the unit the full model
# repeats, small enough to test a whole step against the CPU reference.

const d = 768
const n_heads = 12

dim B, T
input x: f32[B, T, d]
input target: f32[B, T, d]

param ln_1_w: [d] = ones
param ln_1_b: [d] = zeros
param c_attn_w: [d, 3 * d] = normal(0.02)
param c_attn_b: [3 * d] = zeros
param c_proj_w: [d, d] = normal(0.02)
param c_proj_b: [d] = zeros
param ln_2_w: [d] = ones
param ln_2_b: [d] = zeros
param c_fc_w: [d, 4 * d] = normal(0.02)
param c_fc_b: [4 * d] = zeros
param mlp_proj_w: [4 * d, d] = normal(0.02)
param mlp_proj_b: [d] = zeros

# Attention: one projection to q, k and v, split into heads.
let qkv = linear(layernorm(x, ln_1_w, ln_1_b), c_attn_w, c_attn_b)
let q, k, v = split(qkv, 3)
let y = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads), causal = true)
let x1 = x + linear(merge_heads(y), c_proj_w, c_proj_b)

# MLP.
let h = gelu(linear(layernorm(x1, ln_2_w, ln_2_b), c_fc_w, c_fc_b))
let out = x1 + linear(h, mlp_proj_w, mlp_proj_b)

let err = out - target
train {
    loss = mean(err * err)
    optimizer = adamw(lr = 3e-4, betas = (0.9, 0.95), weight_decay = 0.1)
    precision = bf16
}
