# Sizes named as generated kernels name their own variables (C, S, V, n,
# rows): the kernels must keep the two apart.
dim C, S, n, rows
const V = 40
input x: f32[C, S, 16]
input t: i32[n, rows]
input y: f32[C, S, 16]
param w: [16] = ones
param b: [16] = zeros
param table: [V, 16] = normal(0.02)
let h = layernorm(x * w + b, w, b)
let e = embedding(table, t)
train {
    loss = mean((h - y) * (h - y)) + mean(e * e)
    optimizer = adamw(lr = 1e-3)
}
