# The learning rate is given by position; optimizer settings are named.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    optimizer = adamw(3e-4)
}
