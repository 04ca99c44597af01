# The head size divides by a head count of 0.
const d = 64
const n_heads = 0
const head_dim = d / n_heads
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
}
