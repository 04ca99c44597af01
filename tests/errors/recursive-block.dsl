# A block calls itself instead of using `repeat`.
const d = 64
dim B
input x: f32[B, d]

block layer(x) {
    param w: [d, d] = normal(0.02)
    let h = x + gelu(x @ w)
    return layer(h)
}

train {
    loss = mean(layer(x))
}
