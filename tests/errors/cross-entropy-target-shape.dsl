# The targets are one per sequence, but the logits are one per token.
const vocab = 1000
const d = 64
dim B, T
input tokens: i32[B, T]
input targets: i32[B]
param wte: [vocab, d] = normal(0.02)
param head: [d, vocab] = normal(0.02)

let logits = embedding(wte, tokens) @ head

train {
    loss = cross_entropy(logits, targets)
}
