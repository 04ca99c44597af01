# The optimizer is `adamw`, not `adam`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    optimizer = adam(lr = 3e-4)
}
