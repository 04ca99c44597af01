# A schedule misspelt: `cosin` for `cosine`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    optimizer = adamw(lr = 3e-4)
    schedule = cosin(warmup = 10)
}
