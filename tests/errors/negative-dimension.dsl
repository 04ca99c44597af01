# The hidden size is computed as negative.
const d = 64
const hidden = d - 128
dim B
input x: f32[B, d]
param w: [d, hidden] = normal(0.02)

train {
    loss = mean(x @ w)
}
