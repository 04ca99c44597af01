# An i32 input is added to a float tensor.
const d = 64
dim B, T
input x: f32[B, T, d]
input positions: i32[B, T, d]
param w: [d, d] = normal(0.02)

let h = x @ w + positions

train {
    loss = mean(h * h)
}
