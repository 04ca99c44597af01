# `const` names a number; a tensor needs `let`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

const h = x @ w

train {
    loss = mean(h)
}
