# 64 features do not split into 6 heads.
const d = 64
const n_heads = 6
dim B, T
input x: f32[B, T, d]
param wq: [d, d] = normal(0.02)

let q = heads(x @ wq, n_heads)
let y = attention(q, q, q, causal = true)

train {
    loss = mean(y * y)
}
