# The loss names `logit`, but the model defines `logits`.
const d = 64
const classes = 10
dim B
input x: f32[B, d]
input labels: i32[B]
param w: [d, classes] = normal(0.02)

let logits = x @ w

train {
    loss = cross_entropy(logit, labels)
}
