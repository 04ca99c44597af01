#!/usr/bin/env python3
"""Checks a PyTorch twin (`fusec export-torch`) against fusec's CPU reference.

    python3 tools/twin_check.py twin.py case.json

case.json holds what the reference interpreter computed in f64 at tiny sizes:
the inputs, the parameters, the loss and every parameter's gradient (as the
step graph gives it, already scaled by 1/micro_batches). The twin runs the
same loss in float64 on the CPU; each gradient must agree to `--rtol`
relative to the largest entry of the reference gradient, the loss to `--rtol`
relative. Prints one line per model; exits 1 on a mismatch.

A gradient whose every entry lies under NOISE times the model's largest
gradient entry is rounding noise on both sides (a key bias's gradient is
exactly zero: softmax ignores a shift shared by every key); it is judged
by staying under that floor in the twin too, and its parameter's update (Adam turns noise into
steps of +-lr) is not judged. The line says which tensors those were.
"""

import argparse
import importlib.util
import json
import sys

import torch


def load_twin(path):
    spec = importlib.util.spec_from_file_location("twin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# f64's unit roundoff (1.1e-16) over sums of up to ~1e4 terms at these
# tiny sizes stays under 1e-12 of the largest gradient entry; a true
# gradient below that cannot be told from the rounding of a cancellation.
NOISE = 1e-12


def noise_floor(case):
    return NOISE * max(max((abs(v) for v in g["data"]), default=0.0) for g in case["grads"].values())


def tensor(t):
    return torch.tensor(t["data"], dtype=torch.float64).reshape(t["shape"])


def check_steps(twin, case, rtol, noise):
    """Two optimizer steps of the twin's `train_step` in float64 from the same
    weights: the losses, gradient norms and the change of every parameter
    against fusec's training graph run by the reference interpreter."""
    model = twin.MODEL().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensor(case["params"][name]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = {}
    for name, t in case["inputs"].items():
        dtype = torch.int32 if t["dtype"] == "i32" else torch.float64
        inputs[name] = torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])
    opt = twin.make_optimizer(model, case["lr"])
    failures, worst, where = [], 0.0, "-"
    for i, want in enumerate(case["steps"]):
        loss, norm = twin.train_step(model, opt, [inputs] * twin.MICRO_BATCHES, lr=case["lr"], precision="fp64")
        checks = [("loss", loss, want["loss"])]
        if want["grad_norm"] is not None:
            checks.append(("grad norm", norm, want["grad_norm"]))
        for what, got, ref in checks:
            err = abs(got - ref) / max(abs(ref), 1e-300)
            if err > worst:
                worst, where = err, f"step {i + 1} {what}"
            if not err <= rtol:
                failures.append(f"step {i + 1} {what}: twin {got!r}, fusec {ref!r}")
    for name, p in model.named_parameters():
        if name in noise:
            continue
        want = tensor(case["params_after"][name]) - before[name]
        got = p.detach() - before[name]
        scale = want.abs().max().item()
        err = (got - want).abs().max().item() / max(scale, 1e-300)
        if scale == 0.0:
            err = got.abs().max().item()
        if err > worst:
            worst, where = err, f"update of {name}"
        if not err <= rtol:
            failures.append(f"update of {name}: max error {err:.3e} relative to its largest change")
    status = "FAIL" if failures else "ok"
    print(f"{status} {case['model']}: 2 training steps, worst relative error {worst:.2e} ({where})")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("twin")
    ap.add_argument("case")
    ap.add_argument("--rtol", type=float, default=1e-9)
    args = ap.parse_args()
    twin = load_twin(args.twin)
    with open(args.case) as f:
        case = json.load(f)
    model = twin.MODEL().double()
    state = model.state_dict()
    missing = [n for n in state if n not in case["params"]]
    extra = [n for n in case["params"] if n not in state]
    if missing or extra:
        print(f"FAIL {args.twin}: parameter names differ: twin only {missing}, fusec only {extra}")
        return 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = case["params"][name]
            p.copy_(torch.tensor(t["data"], dtype=torch.float64).reshape(t["shape"]))
    inputs = {}
    for name, t in case["inputs"].items():
        dtype = torch.int32 if t["dtype"] == "i32" else torch.float64
        inputs[name] = torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])
    loss = model(**inputs)
    (loss * case["grad_scale"]).backward()
    worst = abs(loss.item() - case["loss"]) / max(abs(case["loss"]), 1e-300)
    where = "loss"
    failures, noise = [], []
    floor = noise_floor(case)
    if worst > args.rtol:
        failures.append(f"loss: twin {loss.item()!r}, fusec {case['loss']!r}")
    for name, p in model.named_parameters():
        ref = case["grads"][name]
        want = torch.tensor(ref["data"], dtype=torch.float64).reshape(ref["shape"])
        got = p.grad if p.grad is not None else torch.zeros_like(want)
        scale = want.abs().max().item()
        if scale <= floor:
            # Noise on both sides: the twin's must stay under the floor too.
            noise.append(name)
            if (got - want).abs().max().item() > floor:
                failures.append(f"grad {name}: rounding noise in fusec (under {floor:.1e}), {got.abs().max().item():.3e} in the twin")
            continue
        err = (got - want).abs().max().item() / max(scale, 1e-300)
        if err > worst:
            worst, where = err, name
        if not err <= args.rtol:
            failures.append(f"grad {name}: max error {err:.3e} relative to its largest entry")
    status = "FAIL" if failures else "ok"
    print(f"{status} {case['model']}: loss {loss.item():.12g}, worst relative error {worst:.2e} ({where})")
    if noise:
        print(f"    gradients that are rounding noise (under {floor:.1e}), their updates not judged: {', '.join(noise)}")
    if "steps" in case:
        failures += check_steps(twin, case, args.rtol, set(noise))
    for f in failures[:20]:
        print("   ", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
