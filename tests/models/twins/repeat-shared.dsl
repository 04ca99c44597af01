# `repeat` whose other argument is the tensor it starts from, under a name
# the loop result takes too; a block named `f` (its class must not hide
# torch.nn.functional, imported as F).
const d = 6

dim B
input x: f32[B, d]

block f(h, x0) {
    param w: [d, d] = normal(0.3)
    return gelu(h @ w) + x0
}

let h = x * 2
let h = repeat 3 f(h, h)
train {
    loss = mean(h * h)
    optimizer = sgd(lr = 0.1)
}
