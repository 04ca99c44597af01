# A hidden size of 0.
const d = 64
const hidden = 0
dim B
input x: f32[B, d]
param w1: [d, hidden] = normal(0.02)
param w2: [hidden, d] = normal(0.02)

train {
    loss = mean(gelu(x @ w1) @ w2)
}
