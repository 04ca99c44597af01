# `let` takes no type annotation; types are inferred.
const d = 64
dim B
input x: f32[B, d]
param w: [d, d] = normal(0.02)

let h: f32 = x @ w

train {
    loss = mean(h)
}
