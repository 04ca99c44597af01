# The arguments of `embedding` are swapped: the table comes first.
const vocab = 1000
const d = 64
dim B, T
input tokens: i32[B, T]
param wte: [vocab, d] = normal(0.02)

let x = embedding(tokens, wte)

train {
    loss = mean(x * x)
}
