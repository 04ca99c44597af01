# NHWC convolutions, stride 2 with padding 1, then 1; relu, sigmoid, tanh;
# 3 micro-batches with SGD and momentum.
dim B
input img: f32[B, 9, 9, 3]
input labels: i32[B]

param k1: [3, 3, 3, 8] = normal(0.2)
param b1: [8] = zeros
param k2: [2, 2, 8, 6] = uniform(0.3)
param w: [6, 7] = normal(0.1)

let h = relu(conv2d(img, k1, stride = 2, padding = 1) + b1)
let h2 = sigmoid(conv2d(h, k2)) * tanh(h[:, 0:4, 0:4, 0:6])
let pooled = mean(reshape(h2, [B, -1, 6]), axis = 1)
train {
    loss = cross_entropy(pooled @ w, labels)
    optimizer = sgd(lr = 0.1, momentum = 0.8)
    micro_batches = 3
}
