# `repeat` names `layr`, a typo for the block `layer`.
const d = 64
const layers = 4
dim B
input x: f32[B, d]

block layer(x) {
    param w: [d, d] = normal(0.02)
    return x + gelu(x @ w)
}

let y = repeat layers layr(x)

train {
    loss = mean(y * y)
}
