# `$` is not an operator in a model file.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h = x $ w

train {
    loss = mean(h)
}
