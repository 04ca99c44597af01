# Blocks take positional arguments only.
const d = 64
dim B
input x: f32[B, d]

block mlp(x) {
    param w: [d, d] = normal(0.02)
    return gelu(x @ w)
}

let y = mlp(x = x)

train {
    loss = mean(y * y)
}
