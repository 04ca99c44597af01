# Two parameters are named `w`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, 4 * d] = normal(0.02)
param w: [4 * d, d] = normal(0.02)

train {
    loss = mean(x @ w)
}
