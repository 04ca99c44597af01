# `split` gives three parts, but only two names are bound.
const d = 64
dim B, T
input x: f32[B, T, d]
param qkv_w: [d, 3 * d] = normal(0.02)

let q, k = split(x @ qkv_w, 3)

train {
    loss = mean(q * k)
}
