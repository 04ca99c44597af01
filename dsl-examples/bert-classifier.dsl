# BERT fine-tuning for sequence classification, as Hugging Face's
# BertForSequenceClassification builds it (bert-base sizes; bert-large with
# --set d=1024 --set layers=24 --set n_heads=16): token, position and
# segment embeddings, post-LayerNorm encoder layers with exact GELU, the
# pooler (tanh of a dense layer on the first token, [CLS]) and a linear
# classifier. Batches are padded: each sentence's length masks its padded
# keys in every attention. Dropout 0.1 after the embeddings, on the
# attention probabilities, after each attention output and feed-forward
# output, and before the classifier, as the model ships.
#
# Weights: --init-from a save_pretrained checkpoint with
# --name-map dsl-examples/maps/hf-bert.json. Data: labelled sentences
# (text<TAB>class a line) through a tokenizer.json that adds [CLS] ... [SEP].

const vocab = 30522
const ctx = 512
const segments = 2
const d = 768
const n_heads = 12
const layers = 12
const ffn = 4 * d
const classes = 2
const p = 0.1

dim B, T
input tokens: i32[B, T]
input lengths: i32[B]
input segment_ids: i32[B, T]
input labels: i32[B]

block layer(x, lengths) {
    param query_w: [d, d] = normal(0.02)
    param query_b: [d] = zeros
    param key_w: [d, d] = normal(0.02)
    param key_b: [d] = zeros
    param value_w: [d, d] = normal(0.02)
    param value_b: [d] = zeros
    param out_w: [d, d] = normal(0.02)
    param out_b: [d] = zeros
    param ln_attn_w: [d] = ones
    param ln_attn_b: [d] = zeros
    param ff_in_w: [d, ffn] = normal(0.02)
    param ff_in_b: [ffn] = zeros
    param ff_out_w: [ffn, d] = normal(0.02)
    param ff_out_b: [d] = zeros
    param ln_ff_w: [d] = ones
    param ln_ff_b: [d] = zeros
    let q = heads(linear(x, query_w, query_b), n_heads)
    let k = heads(linear(x, key_w, key_b), n_heads)
    let v = heads(linear(x, value_w, value_b), n_heads)
    # Bidirectional: every token sees every real token of its sentence.
    let a = attention(q, k, v, lengths = lengths, dropout = p)
    let x = layernorm(x + dropout(linear(merge_heads(a), out_w, out_b), p), ln_attn_w, ln_attn_b, eps = 1e-12)
    let f = linear(gelu_erf(linear(x, ff_in_w, ff_in_b)), ff_out_w, ff_out_b)
    return layernorm(x + dropout(f, p), ln_ff_w, ln_ff_b, eps = 1e-12)
}

param word_embeddings: [vocab, d] = normal(0.02)
param position_embeddings: [ctx, d] = normal(0.02)
param token_type_embeddings: [segments, d] = normal(0.02)
param emb_ln_w: [d] = ones
param emb_ln_b: [d] = zeros
param pooler_w: [d, d] = normal(0.02)
param pooler_b: [d] = zeros
param classifier_w: [d, classes] = normal(0.02)
param classifier_b: [classes] = zeros

let e = embedding(word_embeddings, tokens) + position_embeddings[0:T] + embedding(token_type_embeddings, segment_ids)
let x = repeat layers layer(dropout(layernorm(e, emb_ln_w, emb_ln_b, eps = 1e-12), p), lengths)
let pooled = tanh(linear(x[:, 0, :], pooler_w, pooler_b))
let logits = linear(dropout(pooled, p), classifier_w, classifier_b)

train {
    # -100 marks the empty rows of a batch cut by a token budget.
    loss = cross_entropy(logits, labels, ignore_index = -100)
    # The Hugging Face Trainer's defaults: AdamW, lr 5e-5 decaying linearly
    # to 0 over the run, no weight decay, fp32.
    optimizer = adamw(lr = 5e-5, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 0.0)
    schedule = linear()
}
