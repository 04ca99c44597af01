# The residual sum has no right-hand side.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h = x +
let y = h @ w

train {
    loss = mean(y)
}
