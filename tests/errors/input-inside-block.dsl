# Inputs are declared at the top level, not inside a block.
const d = 64
dim B
input x: f32[B, d]

block head(x) {
    input labels: i32[B]
    param w: [d, 10] = normal(0.02)
    return cross_entropy(x @ w, labels)
}

train {
    loss = head(x)
}
