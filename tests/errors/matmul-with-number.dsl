# `@` is a matrix product; scaling by a number uses `*`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h = (x @ w) @ 0.5

train {
    loss = mean(h * h)
}
