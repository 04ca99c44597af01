# AdamW's second beta is given as 1.5; betas must be in [0, 1).
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    optimizer = adamw(lr = 3e-4, betas = (0.9, 1.5))
}
