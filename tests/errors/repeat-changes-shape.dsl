# The repeated block widens its input, so layer 1 cannot take layer 0's output.
const d = 64
const layers = 4
dim B
input x: f32[B, d]

block layer(x) {
    param w: [d, 2 * d] = normal(0.02)
    return gelu(x @ w)
}

let y = repeat layers layer(x)

train {
    loss = mean(y)
}
