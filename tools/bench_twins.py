#!/usr/bin/env python3
"""fusec beside torch.compile of each model's PyTorch twin, one table.

    python3 tools/bench_twins.py --fusec out/device/fusec                 # the shipped transformers
    python3 tools/bench_twins.py --fusec out/device/fusec my.dsl --batches 8 --seq 2048

For each model and batch size: `fusec bench` (one JSON line), then the twin
that `fusec export-torch` writes, timed in its own process (so that each
measures its own peak memory and torch.compile starts clean): the model
under torch.compile (default mode), bf16/fp16 autocast over f32 weights as
the model's `precision` says, fused AdamW or SGD from `make_optimizer`, the
model's gradient clipping. Both run one micro-batch per step with the update
applied (what `fusec bench` times), on random inputs of the same shapes,
three warm-up steps (torch.compile compiles in them) and then the median of
--steps timed steps. Memory is the device's in use (total minus free) after
the timed steps, for both: the CUDA context included.

A size that does not fit is a row that says so. Prints the table, and with
--out writes every measurement as JSON lines. The ratio is torch.compile's
milliseconds over fusec's: above 1, fusec is faster.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# The shipped transformers, with the sequence length each is benchmarked at
# (BERT's position table has 512 rows; ViT's sequence is its patches).
SHIPPED = [
    ("dsl-examples/gpt2-small.dsl", 1024),
    ("dsl-examples/llama-small.dsl", 1024),
    ("dsl-examples/bert-encoder.dsl", 512),
    ("dsl-examples/gpt2-block.dsl", 1024),
    ("dsl-examples/vit-tiny.dsl", None),
]


def load_twin(path):
    spec = importlib.util.spec_from_file_location("twin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- one measurement of the twin, in a process of its own ----


def checkpoint_layers(model):
    """Activation checkpointing, as PyTorch users write it: each layer of
    every `repeat` (an nn.ModuleList of the twin) runs under
    torch.utils.checkpoint, keeping only its input for the backward pass.
    Returns how many layers it wrapped."""
    import torch
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return checkpoint(self.inner, *args, use_reentrant=False)

    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            for i in range(len(m)):
                m[i] = Checkpointed(m[i])
                n += 1
    return n


def torch_one(twin_path, sizes, mode, steps, device):
    """`mode`: compiled or eager, with `-ckpt` for activation checkpointing
    of every layer."""
    import torch

    twin = load_twin(twin_path)
    torch.manual_seed(0)
    model = twin.MODEL().to(device)
    base, _, ckpt = mode.partition("-")
    wrapped = checkpoint_layers(model) if ckpt == "ckpt" else 0
    opt = twin.make_optimizer(model)
    scaler = twin.make_scaler(device)
    run = torch.compile(model) if base == "compiled" else model
    inputs = twin.random_inputs(sizes, device)
    # As `fusec bench` feeds them (--lengths full): every attention length
    # input (an i32 [B] whose bound is a dimension's size + 1) at its size.
    for name, (dt, shape, high) in twin.INPUTS.items():
        if dt == "i32" and shape == ["B"] and high and any(high == v + 1 for v in sizes.values()):
            inputs[name].fill_(high - 1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    batch = [inputs]

    def step():
        # The twin's own step, without reading the loss back (no wait).
        twin.train_step_tensors(run, opt, batch, scaler=scaler, norm=False)

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    sync()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    out = {"ms_per_step": statistics.median(times), "warmup_s": warm_s, "device": device}
    if wrapped:
        out["checkpointed_layers"] = wrapped
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        out.update(
            peak_memory_gib=(total - free) / 2**30,
            max_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
            device=torch.cuda.get_device_name(),
        )
    return out


# ---- the driver ----


def fusec_bench(args, model, sizes):
    cmd = [args.fusec, "bench", model, "--steps", str(args.steps)]
    for k, v in sizes.items():
        cmd += ["--dim", f"{k}={v}"]
    for s in args.set:
        cmd += ["--set", s]
    if args.precision:
        cmd += ["--precision", args.precision]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        return {"error": last_line(r.stderr)}
    return json.loads(r.stdout.strip().splitlines()[-1])


def torch_bench(args, twin_path, sizes, mode):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-one", twin_path,
           "--sizes", json.dumps(sizes), "--mode", mode, "--steps", str(args.steps)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.timeout} s"}
    if r.returncode != 0:
        return {"error": last_line(r.stderr)}
    return json.loads(r.stdout.strip().splitlines()[-1])


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    for l in reversed(lines):
        if "out of memory" in l.lower() or "error" in l.lower():
            return l.strip()[:160]
    return (lines[-1].strip() if lines else "failed")[:160]


def sizes_for(twin, batch, seq, extra=()):
    sizes = {}
    given = dict(kv.split("=") for kv in extra)
    for d in twin.DIMS:
        if d == "B":
            sizes[d] = batch
        elif d in given:
            sizes[d] = int(given[d])
        elif d == "T" and seq is not None:
            sizes[d] = seq
        else:
            raise SystemExit(f"error: the model has a dimension `{d}` this script does not size (it sizes B and T; --dim NAME=N for others)")
    return sizes


def tokens(sizes):
    """Tokens a step reads: B x the sequence lengths (S + T for an
    encoder-decoder)."""
    rest = [v for k, v in sizes.items() if k != "B"]
    return sizes.get("B", 1) * (sum(rest) if rest else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="model files (default: the shipped transformers)")
    ap.add_argument("--fusec", default="target/release/fusec")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--seq", type=int, default=1024, help="T for the models given (the shipped ones have their own)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="for every model given")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="a dimension other than B and T (e.g. S=128)")
    ap.add_argument("--precision", help="fp32, bf16 or fp16 in place of each model file's (fusec and its twin alike)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="compiled", help="compiled, eager, and either with -ckpt (every layer under torch.utils.checkpoint), comma-separated")
    ap.add_argument("--timeout", type=int, default=600, help="seconds for each measurement")
    ap.add_argument("--out", help="append every measurement here as JSON lines")
    ap.add_argument("--only", metavar="REGEX", help="of the shipped models, those whose file name matches")
    ap.add_argument("--torch-one", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_one:
        print(json.dumps(torch_one(args.torch_one, json.loads(args.sizes), args.mode, args.steps, args.device)))
        return
    if not os.path.exists(args.fusec):
        raise SystemExit(f"error: no fusec binary at {args.fusec}; build it (cargo build --release) or pass --fusec")
    models = [(m, args.seq) for m in args.models] or SHIPPED
    if args.only:
        import re
        models = [m for m in models if re.search(args.only, os.path.basename(m[0]))]
    modes = args.modes.split(",")
    work = tempfile.mkdtemp(prefix="bench-twins-")
    rows = []
    out = open(args.out, "a") if args.out else None
    for model, seq in models:
        name = os.path.basename(model)[:-4]
        twin_path = os.path.join(work, f"{name.replace('-', '_')}_twin.py")
        cmd = [args.fusec, "export-torch", model, "-o", twin_path]
        for s in (args.set if args.models else []):
            cmd += ["--set", s]
        if args.precision:
            cmd += ["--precision", args.precision]
        subprocess.run(cmd, check=True)
        twin = load_twin(twin_path)
        for b in [int(x) for x in args.batches.split(",")]:
            sizes = sizes_for(twin, b, seq, args.dim)
            print(f"== {name} {sizes}", flush=True)
            f = fusec_bench(args, model, sizes)
            row = {"model": name, "sizes": sizes, "precision": twin.PRECISION, "fusec": f}
            print("  fusec", json.dumps(f), flush=True)
            for mode in modes:
                t = torch_bench(args, twin_path, sizes, mode)
                print(f"  torch {mode}", json.dumps(t), flush=True)
                row[mode] = t
            rows.append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    table(rows, modes)


def table(rows, modes):
    def ms(r):
        return r.get("ms_per_step") if isinstance(r, dict) else None

    def gib(r):
        g = r.get("peak_memory_gib")
        return "-" if g is None else f"{g:.1f}"

    head = f"| model | sizes | fusec ms | fusec tok/s | fusec GiB |"
    rule = "|---|---|---|---|---|"
    for m in modes:
        head += f" torch {m} ms | {m} GiB | ratio |"
        rule += "---|---|---|"
    print()
    print(head)
    print(rule)
    for r in rows:
        f = r["fusec"]
        n = tokens(r["sizes"])
        sizes = ", ".join(f"{k}={v}" for k, v in r["sizes"].items())
        if ms(f) is None:
            line = f"| {r['model']} | {sizes} | {f.get('error', 'failed')} | | |"
        else:
            line = f"| {r['model']} | {sizes} | {ms(f):.2f} | {n / (ms(f) / 1e3):,.0f} | {gib(f)} |"
        for m in modes:
            t = r[m]
            if ms(t) is None:
                line += f" {t.get('error', 'failed')} | | |"
            else:
                ratio = f"{ms(t) / ms(f):.2f}" if ms(f) else "-"
                line += f" {ms(t):.2f} | {gib(t)} | {ratio} |"
        print(line)


if __name__ == "__main__":
    main()
