# fp16 needs loss scaling, which does not yet combine with micro-batches.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

train {
    loss = mean(x @ w)
    precision = fp16
    micro_batches = 4
}
