# `d` is a number and cannot be indexed.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h = x @ w[0:d] + d[0]

train {
    loss = mean(h)
}
