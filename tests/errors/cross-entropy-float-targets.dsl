# The class labels are declared f32; `cross_entropy` needs i32 targets.
const d = 64
const classes = 10
dim B
input x: f32[B, d]
input labels: f32[B]
param w: [d, classes] = normal(0.02)

train {
    loss = cross_entropy(x @ w, labels)
}
