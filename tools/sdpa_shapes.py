#!/usr/bin/env python3
"""PyTorch SDPA's attention forward and forward + backward at the shapes
`fusec bench-attention` times, grouped queries and S != T included.

The sizes follow `fusec bench-attention` (runtime/src/attn_bench.rs,
`Config::sweep`): B = 16384 / T sequences (or --batch), H = 2048 / D query
heads rounded down to a multiple of --group, H / group key/value heads, S =
--kv-seq or T keys, and the same FLOP count (4 D per visible (query, key) pair
and head for the forward, 3.5 times that for forward + backward), so that the
two print comparable TFLOP/s. One JSON line per point, as bench-attention's.

    python3 tools/sdpa_shapes.py --head-dims 64,128 --seqs 1024,4096 --group 8
    python3 tools/sdpa_shapes.py --head-dims 80 --seqs 1024 --kv-seq 4096 --masks none
"""
import argparse
import json

import torch
import torch.nn.functional as F


def forward_flops(b, h, t, s, d, causal):
    if causal:
        full = min(t, s)
        pairs = full * (full + 1) / 2 + max(t - full, 0) * s
    else:
        pairs = t * s
    return 4.0 * b * h * pairs * d


def median_ms(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end))
    ts.sort()
    return ts[len(ts) // 2]


def point(d, t, s, batch, group, causal, dtype):
    b = batch or max(1, 16384 // t)
    h = max((2048 // d) // group * group, group)
    hkv = h // group
    q = torch.randn(b, h, t, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
    do = torch.randn(b, h, t, d, device="cuda", dtype=dtype)
    # SDPA's causal mask for S != T is the top-left one (query i sees keys
    # 0 ..= i), as fusec's.
    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)

    def fwd_bwd():
        fwd().backward(do)

    fl = forward_flops(b, h, t, s, d, causal)
    f_ms, fb_ms = median_ms(fwd), median_ms(fwd_bwd)
    return dict(bench="attention", impl="sdpa", head_dim=d, seq=t, kv_seq=s, batch=b, heads=h, group=group,
                causal=causal, fwd_ms=round(f_ms, 3), fwd_tflops=round(fl / f_ms / 1e9, 1),
                fwd_bwd_ms=round(fb_ms, 3), fwd_bwd_tflops=round(3.5 * fl / fb_ms / 1e9, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--kv-seq", type=int, default=0, help="keys per sequence (default: the query length)")
    ap.add_argument("--batch", type=int, default=0, help="sequences (default 16384 / T)")
    ap.add_argument("--group", type=int, default=1, help="query heads per key/value head")
    ap.add_argument("--masks", default="causal", help="causal, none, or both: causal,none")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    a = ap.parse_args()
    if a.group < 1 or a.kv_seq < 0 or a.batch < 0:
        ap.error("the group must be at least 1, --kv-seq and --batch not negative")
    dtype = getattr(torch, a.dtype)
    masks = a.masks.split(",")
    if not masks or any(m not in ("causal", "none") for m in masks):
        ap.error("--masks takes causal, none or both (causal,none)")
    causals = [m == "causal" for m in masks]
    for d in (int(x) for x in a.head_dims.split(",")):
        for t in (int(x) for x in a.seqs.split(",")):
            for c in causals:
                try:
                    r = point(d, t, a.kv_seq or t, a.batch, a.group, c, dtype)
                except torch.cuda.OutOfMemoryError:
                    r = dict(bench="attention", impl="sdpa", head_dim=d, seq=t, oom=True)
                print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
