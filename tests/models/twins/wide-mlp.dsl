# A regression MLP of width 1713 with silu and a mean squared error; fp16
# and SGD.
const d_in = 33
const width = 1713

dim B
input x: f32[B, d_in]
input y: f32[B, 1]

param w1: [d_in, width] = normal(0.05)
param b1: [width] = zeros
param w2: [width, 1] = normal(0.01)

let pred = linear(silu(linear(x, w1, b1)), w2)
let err = pred - y
train {
    loss = mean(err * err)
    optimizer = sgd(lr = 0.01)
    precision = fp16
}
