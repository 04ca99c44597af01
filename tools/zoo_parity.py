#!/usr/bin/env python3
"""Twin parity over drawn models: tools/twin_parity.py on every model file
in a folder (written by the model zoo test, `FUSEC_ZOO_WRITE=DIR cargo test
--release --test model_zoo`; each file's first line gives its sizes), for
several seeds, in fp32 and in bf16, with step 1 tensor by tensor.

    python3 tools/zoo_parity.py DIR [--models 20] [--seeds 3] [--steps 40]
        [--start 0] [--jobs 1] [--fusec out/device/fusec] [--cpu]
        [--out zoo_parity.json]

For each run it records the verdict (the path rule, and the per-tensor
rule at step 1) and, in bf16, the drift ratio: fusec's distance from the
float64 twin over the bf16 twin's distance, for the loss, as the median
over the second half of the steps (and at the last step). Dropout is
turned off (`--set p_drop=0 --set p_attn=0`): the twin's masks are
PyTorch's. It prints one line a run and the
distribution of the bf16 ratios (median, quartiles, largest); the bar the
numerics are held to is a median of at most 1.5 and no model over 3.

A failing run also prints the tensors and steps outside their allowance
(and keeps them in --out's JSON), so a sweep on the GPU machine says what
failed without a second run.

Exit status 0 when every run passes the path rule and the per-tensor rule.
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile


def sizes_of(path):
    first = open(path).readline()
    if not first.startswith("# sizes: "):
        raise SystemExit(f"error: {path}: the first line should be `# sizes: B=2 T=3` (as the model zoo writes it)")
    return first[len("# sizes: "):].split()


def ratios(result):
    """bf16 drift ratios of one precision's result: fusec's loss distance
    from the f64 twin over the bf16 twin's, at the last step, and the median
    over the second half of the steps (one step's ratio is a noisy figure:
    the two distances are each a draw of rounding noise)."""
    out = []
    for row in result["rows"]:
        c = row.get("loss")
        if c and c["fusec"] is not None and c["twin"]:
            out.append((row["step"], c["fusec"] / c["twin"]))
    if not out:
        return None, None
    half = out[-1][0] / 2
    return out[-1][1], statistics.median(r for s, r in out if s > half)


def one_run(args, here, f, path, dims, seed, precision):
    """One model, seed and precision through tools/twin_parity.py; prints
    its line (and, failing, what failed) when it ends."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    # Dropout off: the twin draws its masks from PyTorch's generator, not
    # fusec's (every drawn model has the rates as these constants).
    cmd = [sys.executable, os.path.join(here, "twin_parity.py"), path, "--fusec", args.fusec,
           "--steps", str(args.steps), "--seed", str(seed), "--precision", precision,
           "--tensors", "1", "--out", out, "--set", "p_drop=0", "--set", "p_attn=0"] + dims
    if args.cpu:
        cmd.append("--cpu")
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        result = json.load(open(out))["results"][0]
    except (OSError, ValueError, IndexError, KeyError):
        result = None
    os.unlink(out)
    if result is None:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        print(f"{f} seed {seed} {precision}: no result (exit {r.returncode}): {' | '.join(tail)}", flush=True)
        return {"model": f, "seed": seed, "precision": precision, "ok": False, "error": "\n".join(tail)}
    last, med = ratios(result) if precision != "fp32" else (None, None)
    run = {"model": f, "seed": seed, "precision": precision, "ok": result["ok"],
           "verdict": result["verdict"], "worst_share": result["worst_share"],
           "ratio_last": last, "ratio_median": med}
    extra = (f", drift ratio {med:.2f} (median over steps {args.steps // 2 + 1}-{args.steps}; {last:.2f} at the last)"
             if last else "")
    lines = [f"{f} seed {seed} {precision}: {result['verdict']}, "
             f"{result['worst_share']:.2f} of the path allowance{extra}"]
    if not result["ok"]:
        # What failed, named: the tensors and steps outside, and what the
        # probes at fusec's weights said.
        why = [l.strip() for l in r.stdout.splitlines()
               if "<< outside" in l or "taken at fusec's own weights" in l]
        run["why"] = why
        lines += [f"    {line}" for line in why[:8]]
    print("\n".join(lines), flush=True)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="a folder of drawn model files (FUSEC_ZOO_WRITE)")
    ap.add_argument("--models", type=int, default=20, help="how many of its models, in name order")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--fusec", default="target/release/fusec")
    ap.add_argument("--cpu", action="store_true", help="fusec on its CPU reference interpreter")
    ap.add_argument("--start", type=int, default=0, help="skip this many models first (name order), to split a sweep")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each is its own processes)")
    ap.add_argument("--out", help="write every run's figures here (JSON)")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    files = sorted(f for f in os.listdir(args.dir) if f.endswith(".dsl"))[args.start: args.start + args.models]
    if not files:
        raise SystemExit(f"error: no .dsl files in {args.dir}")
    cases = []
    for f in files:
        path = os.path.join(args.dir, f)
        dims = sum((["--dim", s] for s in sizes_of(path)), [])
        for seed in range(args.seeds):
            for precision in args.precisions.split(","):
                cases.append((f, path, dims, seed, precision))
    # Runs are independent (each its own fusec and twin processes, small
    # models that leave the GPU mostly idle), so --jobs runs several at
    # once; the report keeps the cases' order whatever order they end in.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(lambda c: one_run(args, here, *c), cases))
    ok = all(r["ok"] for r in runs)
    drift = [r["ratio_median"] for r in runs if r.get("ratio_median") is not None]
    # Each model's ratios over its seeds: a bias shows as every seed high,
    # chaos as one seed far from the others.
    for f in files:
        mine = [r["ratio_median"] for r in runs if r["model"] == f and r.get("ratio_median") is not None]
        if len(mine) > 1:
            print(f"{f}: bf16 drift ratios over seeds {', '.join(f'{x:.2f}' for x in mine)}")
    if drift:
        q = statistics.quantiles(drift, n=4) if len(drift) > 1 else [drift[0]] * 3
        print(f"bf16 drift ratio (each run's median over steps {args.steps // 2 + 1}-{args.steps}) over {len(drift)} runs: median {q[1]:.2f}, "
              f"quartiles {q[0]:.2f}-{q[2]:.2f}, largest {max(drift):.2f} "
              f"({'within' if q[1] <= 1.5 and max(drift) <= 3 else 'outside'} the bar: median 1.5, each 3)")
    passed = sum(r["ok"] for r in runs)
    print(f"{passed} of {len(runs)} runs pass the path and per-tensor rules")
    if args.out:
        json.dump({"dir": args.dir, "steps": args.steps, "runs": runs}, open(args.out, "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
