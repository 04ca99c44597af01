# 3 * d features are split into 4 parts.
const d = 64
dim B, T
input x: f32[B, T, d]
param qkv_w: [d, 3 * d] = normal(0.02)

let q, k, v, extra = split(x @ qkv_w, 4)

train {
    loss = mean(q * k * v)
}
