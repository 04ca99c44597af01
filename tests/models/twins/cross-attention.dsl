# A decoder attending to an encoder's output of another length (S != T),
# with concat, split by sizes, broadcast and keepdim reductions.
const d = 24
const n_heads = 2
const vocab = 31

dim B, T, S
input tokens: i32[B, T]
input targets: i32[B, T]
input memory: f32[B, S, d]

param emb: [vocab, d] = normal(0.02)
param w_q: [d, d] = normal(0.05)
param w_kv: [d, 2 * d] = normal(0.05)
param w_o: [d, d] = normal(0.05)
param bias: [1, 1, d] = zeros
param w_mix: [2 * d, d] = normal(0.05)

let x = embedding(emb, tokens)
let k, v = split(memory @ w_kv, [d, d])
let q = heads(x @ w_q, n_heads)
let a = merge_heads(attention(q, heads(k, n_heads), heads(v, n_heads)))
let ctx = mean(memory, axis = 1, keepdim = true)
let both = concat([a @ w_o, broadcast(ctx, [B, T, d])], axis = -1)
let y = both @ w_mix + bias
let scale = sum(y * y, axis = [1, 2], keepdim = true) / (T * d)
train {
    loss = cross_entropy(y @ transpose(emb), targets) + mean(scale)
    optimizer = adamw(lr = 1e-3, weight_decay = 0.0)
}
