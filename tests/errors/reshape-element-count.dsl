# Reshaping [B, 64] to [B, 8, 6] changes the number of elements.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let g = reshape(x @ w, [B, 8, 6])

train {
    loss = mean(g * g)
}
