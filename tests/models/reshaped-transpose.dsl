# A reshape of a transposed tensor read by elementwise ops: no strided
# view says it, but a chain as wide as the reshape reads it in place
# (kernel::fuse::flat_view), forward and backward.
dim B
input x: f32[B, 5, 6]
param w: [30] = normal(0.5)
param v: [5, 6] = normal(0.5)
let t = reshape(transpose(x * v), [B, 30])
let y = tanh(t) * w + reshape(transpose(v), [30])
train {
    loss = sum(y * y) / B
    optimizer = sgd(lr = 0.1)
}
