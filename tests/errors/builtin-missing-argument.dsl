# `layernorm` needs both a weight and a bias.
const d = 64
dim B
input x: f32[B, d]
param ln_w: [d] = ones

let h = layernorm(x, ln_w)

train {
    loss = mean(h * h)
}
