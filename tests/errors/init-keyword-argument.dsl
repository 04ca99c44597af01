# The initialiser's scale is given by keyword; it is positional.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(std = 0.02)

train {
    loss = mean(x @ w)
}
