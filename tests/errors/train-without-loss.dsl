# The train section sets an optimizer but not the loss.
const d = 64
const classes = 10
dim B
input x: f32[B, d]
input labels: i32[B]
param w: [d, classes] = normal(0.02)

let l = cross_entropy(x @ w, labels)

train {
    optimizer = sgd(lr = 0.1)
}
