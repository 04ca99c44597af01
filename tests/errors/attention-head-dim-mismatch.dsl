# Keys are split into 8 heads, queries into 4: the head dims differ.
const d = 64
dim B, T
input x: f32[B, T, d]
param wq: [d, d] = normal(0.02)
param wk: [d, d] = normal(0.02)
param wv: [d, d] = normal(0.02)

let q = heads(x @ wq, 4)
let k = heads(x @ wk, 8)
let v = heads(x @ wv, 8)
let y = attention(q, k, v, causal = true)

train {
    loss = mean(y * y)
}
