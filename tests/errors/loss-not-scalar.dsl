# The loss is the squared error per element, not reduced to a scalar.
const d = 64
dim B
input x: f32[B, d]
input target: f32[B, d]
param w: [d, d] = normal(0.02)

let err = x @ w - target

train {
    loss = err * err
}
