# Parameters are stored in f32; bf16 is a compute precision.
const d = 64
dim B
input x: f32[B, d]
param w: bf16[d, d] = normal(0.02)

train {
    loss = mean(x @ w)
}
