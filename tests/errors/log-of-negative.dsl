# A constant folded from log(-1) has no finite value.
const scale = log(-1)
dim B
input x: f32[B, 4]
param w: [4, 4] = normal(0.02)

train {
    loss = mean(x @ w * scale)
}
