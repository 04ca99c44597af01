# The optimizer is set in a second train section.
const d = 64
const classes = 10
dim B
input x: f32[B, d]
input labels: i32[B]
param w: [d, classes] = normal(0.02)

train {
    loss = cross_entropy(x @ w, labels)
}

train {
    optimizer = sgd(lr = 0.1)
}
