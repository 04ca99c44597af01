# The decay is set to end at step 100, inside the 200 warmup steps.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    optimizer = adamw(lr = 3e-4)
    schedule = cosine(warmup = 200, steps = 100)
}
