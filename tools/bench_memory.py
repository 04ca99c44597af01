#!/usr/bin/env python3
"""A model's step under memory budgets: fusec's recomputation beside
torch.compile with and without activation checkpointing, one table.

    python3 tools/bench_memory.py dsl-examples/gpt2-small.dsl --fusec out/device/fusec \\
        --batch 32 --budgets 12GiB,10GiB,8GiB

For each budget (and none): `fusec bench --memory-budget` (one JSON line:
the step's milliseconds, the plan's arena, which is the predicted peak, and
the device memory the process took since its GPU opened, the measured peak,
as the arena is allocated once). Then the model's PyTorch twin under
torch.compile, plainly and with every layer of each `repeat` under
torch.utils.checkpoint (tools/bench_twins.py times both, each in a process
of its own): its milliseconds, `torch.cuda.max_memory_allocated()` and the
device memory in use. Measured on random inputs, one micro-batch a step
with the update applied, median of --steps steps after three warm-up
steps.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_twins  # noqa: E402


def fusec_row(args, budget):
    cmd = [args.fusec, "bench", args.model, "--steps", str(args.steps),
           "--dim", f"B={args.batch}", "--dim", f"T={args.seq}"]
    for s in args.set:
        cmd += ["--set", s]
    if budget:
        cmd += ["--memory-budget", budget]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        return {"error": bench_twins.last_line(r.stderr)}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    picked = [l.strip() for l in r.stderr.splitlines() if l.startswith("recompute") or "peak (the arena)" in l]
    if picked:
        out["recompute"] = picked
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--fusec", default="target/release/fusec")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budgets", default="12GiB,10GiB,8GiB", help="comma-separated; the step without a budget is timed too")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--torch-modes", default="compiled,compiled-ckpt", help="bench_twins.py modes; empty for none")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", help="append every measurement here as JSON lines")
    args = ap.parse_args()
    if not os.path.exists(args.fusec):
        raise SystemExit(f"error: no fusec binary at {args.fusec}; build it (cargo build --release) or pass --fusec")
    rows = []
    for budget in [""] + [b for b in args.budgets.split(",") if b]:
        r = fusec_row(args, budget)
        print(f"fusec budget={budget or 'none'}", json.dumps(r), flush=True)
        rows.append(("fusec", budget or "none", r))
    modes = [m for m in args.torch_modes.split(",") if m]
    if modes:
        twin_path = os.path.join(tempfile.mkdtemp(prefix="bench-memory-"), "twin.py")
        cmd = [args.fusec, "export-torch", args.model, "-o", twin_path]
        for s in args.set:
            cmd += ["--set", s]
        subprocess.run(cmd, check=True, capture_output=True)
        sizes = {"B": args.batch, "T": args.seq}
        for mode in modes:
            t = bench_twins.torch_bench(args, twin_path, sizes, mode)
            print(f"torch {mode}", json.dumps(t), flush=True)
            rows.append(("torch", mode, t))
    if args.out:
        with open(args.out, "a") as f:
            for who, what, r in rows:
                f.write(json.dumps({"model": args.model, "batch": args.batch, "seq": args.seq, "who": who, "what": what, **r}) + "\n")
    base = rows[0][2].get("ms_per_step")
    print()
    print("| run | ms | vs fusec unbudgeted | predicted peak GiB | measured GiB | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for who, what, r in rows:
        ms = r.get("ms_per_step")
        if ms is None:
            print(f"| {who} {what} | {r.get('error', 'failed')} | | | | |")
            continue
        rel = f"{ms / base:.2f}x" if base else "-"
        if who == "fusec":
            pred, meas = r.get("plan_arena_gib"), r.get("step_memory_gib")
            ratio = f"{meas / pred:.3f}" if pred and meas else "-"
            print(f"| fusec, budget {what} | {ms:.2f} | {rel} | {pred:.2f} | {meas:.2f} | {ratio} |")
        else:
            print(f"| torch {what} | {ms:.2f} | {rel} | | {r.get('max_allocated_gib', 0):.2f} allocated, {r.get('peak_memory_gib', 0):.2f} in use | |")


if __name__ == "__main__":
    main()
