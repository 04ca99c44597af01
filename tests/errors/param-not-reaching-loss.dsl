# The auxiliary head is computed but its output never reaches the loss.
const d = 64
const classes = 10
dim B
input x: f32[B, d]
input labels: i32[B]
param w: [d, classes] = normal(0.02)
param aux_w: [d, classes] = normal(0.02)

let logits = x @ w
let aux_logits = x @ aux_w

train {
    loss = cross_entropy(logits, labels)
}
