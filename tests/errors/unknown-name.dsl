# `hiden` is a typo for `hidden`.
const d = 64
dim B
input x: f32[B, d]
param w1: [d, 4 * d] = normal(0.02)
param w2: [4 * d, d] = normal(0.02)

let hidden = gelu(x @ w1)
let y = hiden @ w2

train {
    loss = mean(y * y)
}
