# PyTorch habit: `dim` is a keyword here, and `softmax` takes `axis`.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let p = softmax(x @ w, dim = -1)

train {
    loss = mean(p * p)
}
