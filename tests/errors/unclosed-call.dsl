# The call to `linear` is never closed.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)
param b: [d] = zeros

let h = gelu(linear(x, w, b)
let y = h * 2

train {
    loss = mean(y)
}
