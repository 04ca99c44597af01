# The position table has 512 rows; the slice asks for 1024.
const ctx = 512
const d = 64
dim B
input x: f32[B, 1024, d]
param wpe: [ctx, d] = normal(0.01)

let h = x + wpe[0:1024]

train {
    loss = mean(h * h)
}
