# Symbolic dimensions are declared at the top level.
const d = 64
dim B
input x: f32[B, d]

block mlp(x) {
    dim H
    param w: [d, d] = normal(0.02)
    return x @ w
}

train {
    loss = mean(mlp(x))
}
