# A positional argument follows a keyword argument.
const d = 64
dim B
input x: f32[B, d]
param ln_w: [d] = ones
param ln_b: [d] = zeros

let h = layernorm(x, eps = 1e-5, ln_w, ln_b)

train {
    loss = mean(h)
}
