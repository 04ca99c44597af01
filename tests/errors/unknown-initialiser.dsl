# `xavier` is not an initialiser.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = xavier

train {
    loss = mean(x @ w)
}
