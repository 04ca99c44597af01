# The fused projection is 2 * d wide, which does not split into q, k and v.
const d = 64
dim B, T
input x: f32[B, T, d]
param qkv_w: [d, 2 * d] = normal(0.02)

let q, k, v = split(x @ qkv_w, 3)

train {
    loss = mean(q * k * v)
}
