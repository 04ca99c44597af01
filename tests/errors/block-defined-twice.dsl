# Two blocks are named `mlp`.
const d = 64
dim B
input x: f32[B, d]

block mlp(x) {
    param w: [d, d] = normal(0.02)
    return gelu(x @ w)
}

block mlp(x) {
    param w: [d, d] = normal(0.02)
    return relu(x @ w)
}

train {
    loss = mean(mlp(x))
}
