# The images have 3 channels, the kernel expects 1.
const d = 64
dim B
input images: f32[B, 32, 32, 3]
param patch_w: [4, 4, 1, d] = normal(0.02)

let p = conv2d(images, patch_w, stride = 4)

train {
    loss = mean(p * p)
}
