# `repeat` applies a block, but `gelu` is a builtin.
const d = 64
const layers = 4
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let y = repeat layers gelu(x @ w)

train {
    loss = mean(y)
}
