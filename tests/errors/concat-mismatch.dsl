# The class token has width 32, the patch tokens width 64.
const d = 64
const patches = 16
dim B
input tokens: f32[B, patches, d]
param cls_token: [1, 1, 32] = zeros

let x = concat([broadcast(cls_token, [B, 1, 32]), tokens], axis = 1)

train {
    loss = mean(x * x)
}
