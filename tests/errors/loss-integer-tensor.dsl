# The loss picks an integer label instead of a floating-point value.
const d = 64
dim B
input x: f32[B, d]
input labels: i32[B]
param w: [d, d] = normal(0.02)

let h = x @ w

train {
    loss = labels[0]
}
