# A `repeat` of zero layers.
const d = 64
const layers = 0
dim B
input x: f32[B, d]

block layer(x) {
    param w: [d, d] = normal(0.02)
    return x + gelu(x @ w)
}

let y = repeat layers layer(x)

train {
    loss = mean(y)
}
