# A position table sized by the symbolic sequence length T cannot be allocated.
const d = 64
dim B, T
input x: f32[B, T, d]
param pos: [T, d] = normal(0.01)

let h = x + pos

train {
    loss = mean(h * h)
}
