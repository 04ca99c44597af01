# The block computes its output but never returns it.
const d = 64
dim B
input x: f32[B, d]

block mlp(x) {
    param w: [d, d] = normal(0.02)
    let h = gelu(x @ w)
}

train {
    loss = mean(mlp(x))
}
