# A block may not take the name of a builtin function (here `gelu`).
dim B
input x: f32[B, 8]
input y: i32[B]

block gelu(h) {
    param w: [8, 8] = normal(0.02)
    return h @ w
}

train {
    loss = cross_entropy(gelu(x), y)
}
