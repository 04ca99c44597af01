# `b2` is declared but never used.
const d = 64
const classes = 10
dim B
input x: f32[B, d]
input labels: i32[B]
param w1: [d, d] = normal(0.02)
param b1: [d] = zeros
param w2: [d, classes] = normal(0.02)
param b2: [classes] = zeros

let h = relu(linear(x, w1, b1))

train {
    loss = cross_entropy(h @ w2, labels)
}
