#!/usr/bin/env python3
"""PyTorch DistributedDataParallel of a model's twin (`fusec export-torch`),
under torch.compile: the multi-GPU baseline for any model fusec trains, as
../shared/bench/torch_ddp.py is for GPT-2. Each rank trains its own random
batch of the twin's shapes (attention lengths full, as `fusec bench` feeds
them) with the twin's optimizer and precision; DDP's default 25 MiB buckets.

    torchrun --standalone --nproc_per_node 2 tools/twin_ddp.py TWIN.py --sizes '{"B": 32, "S": 128, "T": 128}'

Rank 0 prints one JSON line: ms per step (median), tokens/s in all and per
GPU (B x the sequence lengths a rank), peak memory allocated per GPU.
Keep NCCL_NVLS_ENABLE=0 set (NVLink multicast stays off on shared hosts).
"""
import argparse
import importlib.util
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("twin")
    ap.add_argument("--sizes", required=True, help='JSON: each dimension, e.g. {"B": 32, "T": 128}')
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("twin", a.twin)
    twin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(twin)
    sizes = json.loads(a.sizes)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    model = twin.MODEL().cuda()
    ddp = DDP(model, device_ids=[local], bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = twin.make_optimizer(model)
    scaler = twin.make_scaler("cuda")
    run = torch.compile(ddp) if a.mode == "compiled" else ddp
    g = torch.Generator().manual_seed(rank)
    inputs = twin.random_inputs(sizes, "cuda", generator=g)
    for name, (dt, shape, high) in twin.INPUTS.items():
        if dt == "i32" and shape == ["B"] and high and any(high == v + 1 for v in sizes.values()):
            inputs[name].fill_(high - 1)

    def step():
        twin.train_step_tensors(run, opt, [inputs], scaler=scaler, norm=False)

    t0 = time.time()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(a.steps):
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    ms = ts[len(ts) // 2]
    tok = sizes["B"] * sum(v for k, v in sizes.items() if k != "B") * world
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps(dict(bench="twin_ddp", mode=a.mode, gpus=world, gpu=torch.cuda.get_device_name(),
                              sizes_per_gpu=sizes, ms_per_step=round(ms, 3), tokens_per_s=round(tok / ms * 1e3),
                              tokens_per_s_per_gpu=round(tok / ms * 1e3 / world),
                              peak_mem_mib_max=round(peak.item()), warmup_s=round(warm, 1))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
