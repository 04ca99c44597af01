# Indexing with negative positions and `...`, a scalar input, a bf16 input
# in an f32 model, division by a dimension, permute, reshape with -1.
const d = 10

dim B, T
input x: f32[B, T, d]
input noise: bf16[B, T, d]
input temperature: f32[]

param w: [d, d] = normal(0.1)
param table: [8, d] = normal(0.1)

let y = (x + noise) @ w + table[0:T]
let last = y[:, -1, :]
let first = y[:, 0]
let feat = y[..., -2]
let prev = y[:, :-1]
let next = y[:, 1:]
let swapped = permute(y, [2, 0, 1])
let flat = reshape(swapped, [d, -1])
train {
    loss = mean(last * first) + mean(feat) / T + mean(prev * next) / temperature + mean(flat * flat)
    optimizer = adamw(lr = 1e-3, betas = (0.8, 0.9), eps = 1e-6, weight_decay = 0.05)
}
