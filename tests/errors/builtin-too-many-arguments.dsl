# `gelu` takes one argument; the bias was meant for `linear`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)
param b: [d] = zeros

let h = gelu(x @ w, b)

train {
    loss = mean(h)
}
