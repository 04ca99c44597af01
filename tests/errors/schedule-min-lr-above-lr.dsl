# The rate would decay up: min_lr above the optimizer's lr.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    optimizer = adamw(lr = 3e-4)
    schedule = linear(warmup = 10, steps = 1000, min_lr = 1e-3)
}
