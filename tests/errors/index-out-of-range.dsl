# The class token is taken from position 16 of a 16-token sequence (the last is 15).
const patches = 16
const d = 64
const classes = 10
dim B
input x: f32[B, patches, d]
input labels: i32[B]
param head: [d, classes] = normal(0.02)

let cls = x[:, patches, :]

train {
    loss = cross_entropy(cls @ head, labels)
}
