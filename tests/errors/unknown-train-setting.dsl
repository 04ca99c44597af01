# `clip_grad` is a typo for `clip_grad_norm`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    clip_grad = 1.0
}
