# Attention written out by hand at head dim 40: permute, transpose,
# causal_mask, softmax; SGD with momentum and weight decay.
const n_heads = 3
const hd = 40
const d = n_heads * hd
const vocab = 61

dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]

param emb: [vocab, d] = normal(0.02)
param w_qkv: [d, 3 * d] = normal(0.05)
param w_o: [d, d] = normal(0.05)
param g: [d] = ones
param b: [d] = zeros

let x = embedding(emb, tokens)
let q, k, v = split(x @ w_qkv, 3)
let qh = permute(heads(q, n_heads), [0, 2, 1, 3])
let kh = permute(heads(k, n_heads), [0, 2, 1, 3])
let vh = permute(heads(v, n_heads), [0, 2, 1, 3])
let p = softmax(causal_mask(qh @ transpose(kh) * rsqrt(hd)), axis = -1)
let y = merge_heads(transpose(p @ vh, 1, 2))
let x = layernorm(x + y @ w_o, g, b)
train {
    loss = cross_entropy(x @ transpose(emb), targets)
    optimizer = sgd(lr = 0.05, momentum = 0.9, weight_decay = 0.01)
}
