# The vocabulary size does not fit in a 64-bit integer.
const vocab = 99999999999999999999
const d = 64
dim B, T
input tokens: i32[B, T]
param wte: [vocab, d] = normal(0.02)

train {
    loss = mean(embedding(wte, tokens))
}
