# Only one dimension of a reshape can be -1.
const d = 64
dim B, T
input x: f32[B, T, d]

let g = reshape(x, [B, -1, -1])

train {
    loss = mean(g * g)
}
