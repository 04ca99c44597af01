# Scores have three axes; axis 3 does not exist.
const d = 64
dim B, T
input x: f32[B, T, d]
param w: [d, d] = normal(0.02)

let p = softmax(x @ w, axis = 3)

train {
    loss = mean(p * p)
}
