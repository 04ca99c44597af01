# `layer_norm` is spelled `layernorm`.
const d = 64
dim B
input x: f32[B, d]
param ln_w: [d] = ones
param ln_b: [d] = zeros

let h = layer_norm(x, ln_w, ln_b)

train {
    loss = mean(h * h)
}
