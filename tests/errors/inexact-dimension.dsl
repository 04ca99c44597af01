# 64 / 6 is not a whole number, so `head_dim` cannot be a dimension.
const d = 64
const n_heads = 6
const head_dim = d / n_heads
dim B
input x: f32[B, d]
param wq: [d, n_heads * head_dim] = normal(0.02)

train {
    loss = mean(x @ wq)
}
