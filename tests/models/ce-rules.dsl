# A position-wise model whose loss ignores padded targets (id 0) and
# smooths its labels, as a translator's does: every row is independent, so
# a batch padded with more ignored rows gives the same loss and gradients.

const vocab = 61
const d = 24
const smoothing = 0.1
const pad = 0

dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]

param emb: [vocab, d] = normal(0.5)
param w: [d, vocab] = normal(0.5)
param b: [vocab] = zeros

let logits = linear(gelu(embedding(emb, tokens)), w, b)

train {
    loss = cross_entropy(logits, targets, ignore_index = pad, label_smoothing = smoothing)
    optimizer = adamw(lr = 1e-3)
}
