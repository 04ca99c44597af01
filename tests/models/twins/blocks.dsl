# Blocks with numbers and several tensors as arguments, a tuple return,
# nested calls, repeat with an extra argument, two calls of one block, and
# weight tying; exp, log, sqrt and negation.
const d = 12
const vocab = 19

dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]

block norm(x, eps) {
    param g: [d] = ones
    return rmsnorm(x, g, eps = eps)
}

block mix(x, gate) {
    param w: [d, d] = normal(0.1)
    let n = norm(x, 1e-5)
    return x + (n @ w) * sigmoid(gate)
}

block split_stats(x) {
    param w2: [d, 2 * d] = normal(0.1)
    let a, b = split(x @ w2, 2)
    return (a, sqrt(exp(b) + 1))
}

param emb: [vocab, d] = normal(0.1)
param gate: [d] = constant(0.5)

let x = embedding(emb, tokens)
let x = repeat 3 mix(x, gate)
let a, s = split_stats(x)
let y = norm(a * s, 1e-6)
let z = norm(-y, 1e-6) + log(s)
train {
    loss = cross_entropy(z @ transpose(emb), targets)
    clip_grad_norm = 0.5
}
