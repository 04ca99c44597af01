# An encoder-decoder translator with the Annotated Transformer's base sizes
# (Vaswani et al. 2017: 6 + 6 layers, d 512, 8 heads, FFN 2048, dropout 0.1,
# label smoothing 0.1, the warm-up then inverse-square-root rate), over
# padded batches of sentence pairs: each source's length masks the padded
# keys of the encoder's self-attention and of the decoder's
# cross-attention, each target's its padded keys (with the causal mask),
# and the loss ignores padded targets. One vocabulary for both languages,
# its table shared by the two embeddings and the output projection.
# Positions are learned (the paper's are sinusoids).

const vocab = 8000
const ctx = 256
const d = 512
const n_heads = 8
const ffn = 2048
const layers = 6
const p = 0.1
const pad = 0

dim B, S, T
input src: i32[B, S]
input src_len: i32[B]
input tgt_in: i32[B, T]
input tgt_len: i32[B]
input tgt_out: i32[B, T]

block feed_forward(x) {
    param w1: [d, ffn] = normal(0.02)
    param b1: [ffn] = zeros
    param w2: [ffn, d] = normal(0.02)
    param b2: [d] = zeros
    return linear(dropout(relu(linear(x, w1, b1)), p), w2, b2)
}

# Each sublayer as the Annotated Transformer writes it:
# x + dropout(sublayer(norm(x))).
block encoder_layer(x, src_len) {
    param ln1_w: [d] = ones
    param ln1_b: [d] = zeros
    param qkv_w: [d, 3 * d] = normal(0.02)
    param qkv_b: [3 * d] = zeros
    param out_w: [d, d] = normal(0.02)
    param out_b: [d] = zeros
    param ln2_w: [d] = ones
    param ln2_b: [d] = zeros
    let q, k, v = split(linear(layernorm(x, ln1_w, ln1_b), qkv_w, qkv_b), 3)
    let a = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads), lengths = src_len, dropout = p)
    let x = x + dropout(linear(merge_heads(a), out_w, out_b), p)
    return x + dropout(feed_forward(layernorm(x, ln2_w, ln2_b)), p)
}

block decoder_layer(y, memory, src_len, tgt_len) {
    param ln1_w: [d] = ones
    param ln1_b: [d] = zeros
    param qkv_w: [d, 3 * d] = normal(0.02)
    param qkv_b: [3 * d] = zeros
    param self_w: [d, d] = normal(0.02)
    param self_b: [d] = zeros
    param ln2_w: [d] = ones
    param ln2_b: [d] = zeros
    param q_w: [d, d] = normal(0.02)
    param q_b: [d] = zeros
    param kv_w: [d, 2 * d] = normal(0.02)
    param kv_b: [2 * d] = zeros
    param cross_w: [d, d] = normal(0.02)
    param cross_b: [d] = zeros
    param ln3_w: [d] = ones
    param ln3_b: [d] = zeros
    let q, k, v = split(linear(layernorm(y, ln1_w, ln1_b), qkv_w, qkv_b), 3)
    let a = attention(heads(q, n_heads), heads(k, n_heads), heads(v, n_heads), causal = true, lengths = tgt_len, dropout = p)
    let y = y + dropout(linear(merge_heads(a), self_w, self_b), p)
    let mk, mv = split(linear(memory, kv_w, kv_b), 2)
    let cq = linear(layernorm(y, ln2_w, ln2_b), q_w, q_b)
    let c = attention(heads(cq, n_heads), heads(mk, n_heads), heads(mv, n_heads), lengths = src_len, dropout = p)
    let y = y + dropout(linear(merge_heads(c), cross_w, cross_b), p)
    return y + dropout(feed_forward(layernorm(y, ln3_w, ln3_b)), p)
}

param emb: [vocab, d] = normal(0.02)
param src_pos: [ctx, d] = normal(0.02)
param tgt_pos: [ctx, d] = normal(0.02)
param enc_ln_w: [d] = ones
param enc_ln_b: [d] = zeros
param dec_ln_w: [d] = ones
param dec_ln_b: [d] = zeros

let scale = sqrt(d)
let x = dropout(embedding(emb, src) * scale + src_pos[0:S], p)
let memory = layernorm(repeat layers encoder_layer(x, src_len), enc_ln_w, enc_ln_b)
let y = dropout(embedding(emb, tgt_in) * scale + tgt_pos[0:T], p)
let h = layernorm(repeat layers decoder_layer(y, memory, src_len, tgt_len), dec_ln_w, dec_ln_b)
let logits = h @ transpose(emb)

train {
    loss = cross_entropy(logits, tgt_out, ignore_index = pad, label_smoothing = 0.1)
    # lr = 1 / sqrt(d * warmup): the paper's d^-0.5 * min(step^-0.5, step * warmup^-1.5).
    optimizer = adamw(lr = 0.000698771, betas = (0.9, 0.98), eps = 1e-9, weight_decay = 0.0)
    schedule = inverse_sqrt(warmup = 4000)
    precision = bf16
}
