# Model files have no strings: the activation is a function, not "gelu".
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h = linear(x, w, activation = "gelu")

train {
    loss = mean(h)
}
