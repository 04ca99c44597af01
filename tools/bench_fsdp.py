#!/usr/bin/env python3
"""PyTorch's fully sharded data parallel (FSDP2: `fully_shard` on each layer
and on the whole model, parameters, gradients and optimizer state split over
the GPUs, bf16 compute over f32 masters, gradients reduced in f32) under
torch.compile, on the twin of dsl-examples/llama-7b.dsl (tools/bench_llama.py's
`Llama`): the peer of `fusec bench dsl-examples/llama-7b.dsl --gpus N --zero N`.
One training step (forward, backward, clipping at 1.0, fused AdamW), median
of --steps steps after three warm-up steps; rank 0 prints one JSON line.

  NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 tools/bench_fsdp.py --batch 1 --seq 2048

--sizes small runs llama-small's sizes (to try the script on small GPUs);
--no-compile leaves torch.compile out; --no-reshard keeps each layer's
gathered parameters from the forward pass to the backward (ZeRO-2's
memory, FSDP's SHARD_GRAD_OP).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_llama import Llama, adamw  # noqa: E402

SIZES = {
    # dsl-examples/llama-7b.dsl
    "7b": dict(vocab=32000, d=4096, heads=32, kv_heads=32, ffn=11008, layers=32),
    # dsl-examples/llama-small.dsl
    "small": dict(vocab=32000, d=768, heads=12, kv_heads=3, ffn=2048, layers=12),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", choices=sorted(SIZES), default="7b")
    ap.add_argument("--batch", type=int, default=1, help="each GPU's batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-reshard", action="store_true")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        sys.exit("error: run under torchrun, e.g. torchrun --standalone --nproc_per_node 2 tools/bench_fsdp.py")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    s = SIZES[args.sizes]
    torch.manual_seed(0)
    # Built on the meta device and materialised sharded: a 7B model's f32
    # weights (27 GB) never sit whole on one GPU.
    with torch.device("meta"):
        model = Llama(s["vocab"], s["d"], s["heads"], s["kv_heads"], s["ffn"], s["layers"], args.seq)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = not args.no_reshard
    for layer in model.layers:
        if not args.no_compile:
            layer.compile()
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
        hd = s["d"] // s["heads"]
        inv = 10000.0 ** (-torch.arange(0, hd // 2, dtype=torch.float32, device="cuda") * 2 / hd)
        ang = torch.arange(args.seq, dtype=torch.float32, device="cuda")[:, None] * inv[None, :]
        model.cos, model.sin = ang.cos(), ang.sin()
    opt = adamw(model)
    g = torch.Generator(device="cuda").manual_seed(rank)
    inp = torch.randint(0, s["vocab"], (args.batch, args.seq), device="cuda", generator=g)
    tgt = torch.randint(0, s["vocab"], (args.batch, args.seq), device="cuda", generator=g)

    def step():
        loss = model(inp, tgt)
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
    ts = []
    for _ in range(args.steps):
        dist.barrier()
        torch.cuda.synchronize()
        a = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - a) * 1e3)
    ts.sort()
    ms = ts[len(ts) // 2]
    peak = torch.tensor([torch.cuda.max_memory_allocated()], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps(dict(model=f"llama-{args.sizes}", framework="fsdp2", compiled=not args.no_compile,
                              reshard_after_forward=reshard, gpus=world, batch_per_gpu=args.batch, seq=args.seq,
                              params=params, ms_per_step=round(ms, 2),
                              tokens_per_s=round(world * args.batch * args.seq / ms * 1e3),
                              tokens_per_s_per_gpu=round(args.batch * args.seq / ms * 1e3),
                              peak_allocated_gib=round(peak.item() / 2**30, 2),
                              warmup_s=round(warm, 1), loss=round(loss.item(), 4))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
