# ViT-Tiny: images in NHWC, a convolutional patch embedding, a class token,
# pre-LayerNorm encoder blocks, and a classification head on the class token.

const image = 224
const patch = 16
const channels = 3
const grid = image / patch
const patches = grid * grid
const d = 192
const n_heads = 3
const layers = 12
const classes = 1000

dim B
input images: f32[B, image, image, channels]
input labels: i32[B]

block encoder(x) {
    param ln_1_w: [d] = ones
    param ln_1_b: [d] = zeros
    param qkv_w: [d, 3 * d] = normal(0.02)
    param qkv_b: [3 * d] = zeros
    param proj_w: [d, d] = normal(0.02)
    param proj_b: [d] = zeros
    param ln_2_w: [d] = ones
    param ln_2_b: [d] = zeros
    param fc1_w: [d, 4 * d] = normal(0.02)
    param fc1_b: [4 * d] = zeros
    param fc2_w: [4 * d, d] = normal(0.02)
    param fc2_b: [d] = zeros
    let q, k, v = split(linear(layernorm(x, ln_1_w, ln_1_b, eps = 1e-6), qkv_w, qkv_b), 3)
    let a = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads))
    let x = x + linear(merge_heads(a), proj_w, proj_b)
    let h = gelu(linear(layernorm(x, ln_2_w, ln_2_b, eps = 1e-6), fc1_w, fc1_b))
    return x + linear(h, fc2_w, fc2_b)
}

# Patch embedding: a patch-sized convolution with stride = patch, channels last.
param patch_w: [patch, patch, channels, d] = normal(0.02)
param patch_b: [d] = zeros
param cls_token: [1, 1, d] = zeros
param pos_embed: [patches + 1, d] = normal(0.02)
param norm_w: [d] = ones
param norm_b: [d] = zeros
param head_w: [d, classes] = normal(0.02)
param head_b: [classes] = zeros

let p = conv2d(images, patch_w, stride = patch) + patch_b
let tokens = reshape(p, [B, patches, d])
let x = concat([broadcast(cls_token, [B, 1, d]), tokens], axis = 1) + pos_embed
let x = repeat layers encoder(x)
let cls = layernorm(x[:, 0, :], norm_w, norm_b, eps = 1e-6)

train {
    loss = cross_entropy(linear(cls, head_w, head_b), labels)
    optimizer = adamw(lr = 1e-3, weight_decay = 0.05)
    clip_grad_norm = 1.0
    precision = bf16
}
