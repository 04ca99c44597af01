# The block `mlp` is passed to `gelu` without being called.
const d = 64
dim B
input x: f32[B, d]

block mlp(x) {
    param w: [d, d] = normal(0.02)
    return x @ w
}

let y = gelu(mlp)

train {
    loss = mean(y)
}
