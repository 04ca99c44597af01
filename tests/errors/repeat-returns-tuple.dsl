# `repeat` needs a block that takes and returns one tensor; this one returns two.
dim B
input x: f32[B, 8]

block pair(h) {
    param w: [8, 8] = normal(0.02)
    return (h @ w, h)
}

let y = repeat 2 pair(x)

train {
    loss = mean(x)
}
