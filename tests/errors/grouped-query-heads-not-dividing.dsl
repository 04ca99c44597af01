# 6 query heads cannot share 4 key/value heads evenly.
const d = 96
const head_dim = 16
const n_heads = 6
const n_kv_heads = 4
dim B, T
input x: f32[B, T, d]
param wq: [d, n_heads * head_dim] = normal(0.02)
param wk: [d, n_kv_heads * head_dim] = normal(0.02)
param wv: [d, n_kv_heads * head_dim] = normal(0.02)

let q = heads(x @ wq, n_heads)
let k = heads(x @ wk, n_kv_heads)
let v = heads(x @ wv, n_kv_heads)
let y = attention(q, k, v, causal = true)

train {
    loss = mean(y * y)
}
