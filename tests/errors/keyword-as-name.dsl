# `input` is a keyword and cannot name a value.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let input = x @ w

train {
    loss = mean(input)
}
