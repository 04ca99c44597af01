# `layernorm` takes `eps`, not `epsilon`.
const d = 64
dim B
input x: f32[B, d]
param ln_w: [d] = ones
param ln_b: [d] = zeros

let h = layernorm(x, ln_w, ln_b, epsilon = 1e-5)

train {
    loss = mean(h * h)
}
