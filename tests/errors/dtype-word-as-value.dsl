# `bf16` is a dtype, not a value that an expression can use.
dim B
input x: f32[B, 8]
param w: [8, 8] = normal(0.02)

train {
    loss = mean(x @ w * bf16)
}
