# The second layer's weight is transposed: [d, 4 * d] instead of [4 * d, d].
const d = 64
dim B, T
input x: f32[B, T, d]
param w1: [d, 4 * d] = normal(0.02)
param w2: [d, 4 * d] = normal(0.02)

let h = gelu(x @ w1)
let y = h @ w2

train {
    loss = mean(y * y)
}
