# The exponent makes this number too large for a 64-bit float.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(1e999)

train {
    loss = mean(x @ w)
}
