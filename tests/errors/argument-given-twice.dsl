# The weight is given by position and again by name.
const d = 64
dim B
input x: f32[B, d]
param ln_w: [d] = ones
param ln_b: [d] = zeros

let h = layernorm(x, ln_w, ln_b, weight = ln_w)

train {
    loss = mean(h * h)
}
