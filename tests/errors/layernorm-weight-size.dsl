# The LayerNorm weight has the MLP's hidden size instead of d.
const d = 64
dim B, T
input x: f32[B, T, d]
param ln_w: [4 * d] = ones
param ln_b: [d] = zeros

let h = layernorm(x, ln_w, ln_b)

train {
    loss = mean(h * h)
}
