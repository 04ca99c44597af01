# The block is called `mlp`, but the model calls `mpl`.
const d = 64
dim B
input x: f32[B, d]

block mlp(x) {
    param w1: [d, 4 * d] = normal(0.02)
    param w2: [4 * d, d] = normal(0.02)
    return gelu(x @ w1) @ w2
}

let y = x + mpl(x)

train {
    loss = mean(y * y)
}
