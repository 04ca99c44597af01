# `float32` is not a dtype; the dtypes are f32, bf16, f16 and i32.
const d = 64
dim B
input x: float32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
}
