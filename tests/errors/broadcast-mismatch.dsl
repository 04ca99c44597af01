# The bias has the hidden size, but is added to the output of size d.
const d = 64
const hidden = 256
dim B, T
input x: f32[B, T, d]
param w: [d, d] = normal(0.02)
param b: [hidden] = zeros

let y = x @ w + b

train {
    loss = mean(y * y)
}
