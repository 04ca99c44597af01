#!/usr/bin/env python3
"""A PyTorch twin of fusec's LLaMA-style model files (dsl-examples/llama-small.dsl,
tests/models/llama-hd80.dsl), timed as torch_reference.py times GPT-2: one
training step (forward, backward, fused AdamW) under bf16 autocast over f32
weights, median of --steps steps after three warm-up steps, one JSON line per
mode. The sizes are the model file's constants, given on the command line.

  python3 tools/bench_llama.py --d 1280 --heads 16 --kv-heads 2 --ffn 3456 --layers 8 \\
      --batch 8 --seq 1024 --modes eager,compiled

The twin means what the model file means (docs/dsl.md): RMSNorm with eps 1e-6,
rotary embedding pairing x[i] with x[i + D/2] (theta 10000), SwiGLU
silu(x Wg) * (x Wu), causal grouped-query attention through SDPA, untied
output projection, weight decay on weights of rank 2 and up, gradient
clipping at 1.0.
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, cos, sin):
    # x: [B, H, T, D]; rotate-half pairs (i, i + D/2).
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Layer(nn.Module):
    def __init__(self, d, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq = nn.Linear(d, heads * self.hd, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, d, bias=False)
        self.w_gate = nn.Linear(d, ffn, bias=False)
        self.w_up = nn.Linear(d, ffn, bias=False)
        self.w_down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    def __init__(self, vocab, d, heads, kv_heads, ffn, layers, seq, theta=10000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = theta ** (-torch.arange(0, hd // 2, dtype=torch.float32) * 2 / hd)
        ang = torch.arange(seq, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.tok_embeddings(idx)
        T = idx.shape[1]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def adamw(model):
    """The model file's optimizer: fused AdamW, weight decay on weights of rank 2 and up."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)


def bench(args, mode):
    torch.manual_seed(0)
    model = Llama(args.vocab, args.d, args.heads, args.kv_heads, args.ffn, args.layers, args.seq).cuda()
    opt = adamw(model)
    fn = torch.compile(model) if mode == "compiled" else model
    inp = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(inp, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    for _ in range(3):
        loss = step()
    torch.cuda.synchronize()
    warm = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(args.steps):
        s.record()
        loss = step()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    ms = ts[len(ts) // 2]
    print(json.dumps(dict(model="llama", mode=mode, d=args.d, heads=args.heads, kv_heads=args.kv_heads,
                          head_dim=args.d // args.heads, batch=args.batch, seq=args.seq,
                          params=sum(p.numel() for p in model.parameters()), ms_per_step=round(ms, 3),
                          tokens_per_s=round(args.batch * args.seq / ms * 1e3),
                          peak_mem_mib=round(torch.cuda.max_memory_allocated() / 2**20),
                          warmup_s=round(warm, 1), loss=round(loss.item(), 4))), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d", type=int, default=1280)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=3456)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="eager,compiled")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        bench(args, mode)


if __name__ == "__main__":
    main()
