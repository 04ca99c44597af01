# The block uses the top-level parameter `w_out` without taking it as an argument.
const d = 64
dim B
input x: f32[B, d]
param w_out: [d, d] = normal(0.02)

block mlp(x) {
    param w_in: [d, d] = normal(0.02)
    return gelu(x @ w_in) @ w_out
}

train {
    loss = mean(mlp(x))
}
