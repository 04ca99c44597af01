# A two-layer perceptron that classifies feature vectors.

const d_in = 784
const d_hidden = 256
const classes = 10

dim B
input x: f32[B, d_in]
input labels: i32[B]

param w1: [d_in, d_hidden] = normal(0.05)
param b1: [d_hidden] = zeros
param w2: [d_hidden, classes] = normal(0.05)
param b2: [classes] = zeros

let h = relu(linear(x, w1, b1))
let logits = linear(h, w2, b2)

train {
    loss = cross_entropy(logits, labels)
    optimizer = sgd(lr = 0.1, momentum = 0.9)
}
