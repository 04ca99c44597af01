# Rotary embedding needs an even head dimension; 60 / 4 = 15.
const d = 60
const n_heads = 4
dim B, T
input x: f32[B, T, d]
param wq: [d, d] = normal(0.02)

let q = rope(heads(x @ wq, n_heads))

train {
    loss = mean(q * q)
}
