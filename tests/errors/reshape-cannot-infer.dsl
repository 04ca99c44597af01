# 64 features do not split into groups of 48, so the -1 cannot be inferred.
const d = 64
dim B
input x: f32[B, d]

let g = reshape(x, [B, -1, 48])

train {
    loss = mean(g * g)
}
