# `gaussian(...)` is spelled `normal(...)`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = gaussian(0.02)

train {
    loss = mean(x @ w)
}
