# The shape of `x` is missing its closing `]`.
const d = 64
dim B, T
input x: f32[B, T, d
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
}
