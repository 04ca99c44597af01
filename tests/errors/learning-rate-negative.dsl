# A negative learning rate.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    optimizer = sgd(lr = -0.1)
}
