# The memory budget (in GiB) must be a positive number.
dim B
input x: f32[B, 4]
param w: [4, 4] = normal(0.1)
train {
    loss = mean(x @ w)
    memory_budget = -2
}
