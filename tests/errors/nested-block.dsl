# A block defined inside another block.
const d = 64
dim B
input x: f32[B, d]

block outer(x) {
    block inner(y) {
        return y
    }
    return inner(x)
}

train {
    loss = mean(outer(x))
}
