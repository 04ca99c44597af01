# `x` has three axes, but four indices are given.
const d = 64
dim B, T
input x: f32[B, T, d]
param w: [d, d] = normal(0.02)

let first = x[:, 0, :, 0]

train {
    loss = mean(first @ w)
}
