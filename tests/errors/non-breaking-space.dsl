# A non-breaking space (U+00A0) pasted from a web page.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h = x @ w

train {
    loss = mean(h)
}
