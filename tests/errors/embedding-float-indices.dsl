# Token ids are declared f32; `embedding` needs i32 indices.
const vocab = 1000
const d = 64
dim B, T
input tokens: f32[B, T]
param wte: [vocab, d] = normal(0.02)

let x = embedding(wte, tokens)

train {
    loss = mean(x * x)
}
