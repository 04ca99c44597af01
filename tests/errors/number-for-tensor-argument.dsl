# LayerNorm is given numbers where it needs weight and bias tensors.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h = layernorm(x @ w, 1.0, 0.0)

train {
    loss = mean(h * h)
}
