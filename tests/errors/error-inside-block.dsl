# The MLP's output weight is [d, d] instead of [4 * d, d]; the error is inside the block.
const d = 64
const layers = 2
dim B, T
input x: f32[B, T, d]

block mlp(x) {
    param fc_w: [d, 4 * d] = normal(0.02)
    param proj_w: [d, d] = normal(0.02)
    return gelu(x @ fc_w) @ proj_w
}

block layer(x) {
    param ln_w: [d] = ones
    param ln_b: [d] = zeros
    return x + mlp(layernorm(x, ln_w, ln_b))
}

let y = repeat layers layer(x)

train {
    loss = mean(y * y)
}
