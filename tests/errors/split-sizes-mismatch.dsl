# The sizes given to `split` add up to 2 * d, but the axis is 3 * d.
const d = 64
dim B, T
input x: f32[B, T, d]
param qkv_w: [d, 3 * d] = normal(0.02)

let q, kv = split(x @ qkv_w, [d, d])

train {
    loss = mean(q * kv)
}
