#!/usr/bin/env python3
"""Per-step parity between fusec and the PyTorch twin of any model file.

    python3 tools/twin_parity.py MODEL.dsl [--cpu] [--data random-stream|random|FILE] [--steps 50]
        [--set NAME=VALUE ...] [--batch N] [--seq N] [--dim NAME=N ...]
        [--precision both|own|fp32|bf16|fp16] [--lr X] [--seed S] [--weights] [--probe K ...]

For each precision asked for, fusec trains the model (on the GPU, or with
--cpu on its CPU reference interpreter) and writes its initial weights
(--save-init), the batches it fed (--save-data) and its per-step loss and
gradient norm (--log). `fusec export-torch` writes the model's twin, which
then trains the same steps from the same weights on the same batches twice:
in float64 (the judge) and in the same precision as fusec (fp32, or bf16/fp16
over f32 weights, with fusec's loss scaling for fp16). In bf16 and fp16 the
twin by default rounds where fusec does (--casting compute: every activation
in the compute dtype); --casting autocast runs it under torch.autocast, which
keeps more in f32 (biases' and residual sums, norms) and so drifts less from
the f64 run than any kernel of fusec's precision can.

Training is chaotic: rounding differences grow step by step, so no fixed
tolerance separates a correct implementation from a wrong one over many
steps. The rule is therefore relative to PyTorch's own error: at every step
fusec's distance from the float64 twin (relative, for the loss and the
gradient norm) must stay within 3x the same-precision twin's distance from
it, or within the precision's floor (1e-5 in fp32, 2e-2 in bf16 and fp16),
whichever is larger. A step fusec skipped for an fp16 overflow is skipped by
the float64 twin too (an overflow is a fact about fp16's range, not about
the arithmetic judged); a skip the fp16 twin disagrees with is reported.

With --weights, every parameter after the last step is compared with the
float64 twin's too (fusec's --save beside the same-precision twin's weights),
the tensors where fusec is furthest ahead of the twin's distance listed
first: where a gradient is less exact, its weights show it.

With --tensors K, step K is also judged tensor by tensor from identical
weights, optimizer state and batch: each parameter's gradient and update
against the float64 twin's (relative L2 and largest difference), within 3x
the same-precision twin's distance or a floor (1e-4 in fp32, 1e-3 in bf16
and fp16) that a 1% error in one tensor, a sign, a transpose or a swap
exceeds (tools/twin_tensors.py). It is part of the verdict: no probe can
turn it into a pass.

With --probe K, fusec also trains K - 1 steps and saves its weights, and
the twin takes step K's gradient at those very weights, in f64, in fp32 and
in the run's precision: fusec's logged norm at step K beside the f64 norm at
its own weights, judged by the same rule against the same-precision twin's
distance, says whether an excess at step K comes from that step's
arithmetic or from the path the weights took to it.

A step outside that allowance is probed (below): the twins take the same
step at fusec's own weights, and where fusec's loss and norm are within the
same rule there (3x the same-precision twin's distance from the f64 step, or
the floor), the step's arithmetic is as exact as PyTorch's and only the
weights' path has parted, as chaotic training does with any rounding. The
probe explains a failure and never turns it into a pass: the verdict then
reads "FAIL (path parted; ...)". A failure at step 1 (same weights on both
sides) or a disagreement about fp16's skipped steps is not probed.

On the GPU fusec's fp32 multiplies in 3xTF32 (TF32 with --tf32): its
allowance and floor scale by how much coarser that arithmetic is than the
fp32 twin's (8x; tools/twin_tensors.py's `arithmetic` says why), in the path
rule as in the per-tensor one.

For a token file the script also cuts the windows itself, as fusec's reader
is documented to (consecutive windows of T + 1 tokens, wrapping around), and
checks they are the batches fusec fed.

Exit status 0 when every step of every precision passes, 1 otherwise.
"""

import argparse
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin_tensors  # noqa: E402

FLOOR = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
SLACK = 3.0


def run(cmd, quiet=False):
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"error: {cmd[0]} {cmd[1]} failed (exit {r.returncode})")
    if not quiet:
        tail = [l for l in r.stderr.splitlines() if l.startswith("step")][-1:]
        for line in tail:
            print("  " + line.strip())
    return r


def load_twin(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_header(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def model_args(args):
    out = []
    for s in args.set:
        out += ["--set", s]
    return out


def size_args(args):
    out = []
    if args.batch is not None:
        out += ["--batch", str(args.batch)]
    if args.seq is not None:
        out += ["--seq", str(args.seq)]
    for d in args.dim:
        out += ["--dim", d]
    return out


def export(args, work, precision):
    path = os.path.join(work, f"twin_{precision or 'own'}.py")
    cmd = [args.fusec, "export-torch", args.model, "-o", path] + model_args(args)
    if precision:
        cmd += ["--precision", precision]
    run(cmd, quiet=True)
    return load_twin(path)


def fusec_train(args, work, precision):
    init = os.path.join(work, f"init_{precision}.safetensors")
    data = os.path.join(work, f"data_{precision}.safetensors")
    log = os.path.join(work, f"fusec_{precision}.jsonl")
    cmd = [args.fusec, "train", args.model, "--precision", precision, "--data", args.data,
           "--steps", str(args.steps), "--seed", str(args.seed),
           "--save-init", init, "--save-data", data, "--log", log]
    if args.weights:
        cmd += ["--save", os.path.join(work, f"final_{precision}.safetensors")]
    cmd += model_args(args) + size_args(args)
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if args.cpu:
        cmd.append("--cpu")
    cmd += args.fusec_arg
    run(cmd)
    steps = [json.loads(line) for line in open(log)]
    return init, data, steps


# ---- the batches ----


def token_file(path):
    """Every token of a data file, as fusec's reader takes them (runtime/src/data.rs)."""
    raw = open(path, "rb").read()
    if path.endswith(".bin"):
        header = struct.unpack("<256i", raw[:1024])
        count = header[2]
        return list(struct.unpack(f"<{count}H", raw[1024 : 1024 + 2 * count]))
    return list(raw)


def windows(tokens, b, t, count):
    """`count` batches of B consecutive windows of T + 1 tokens, wrapping at the end."""
    pos, out = 0, []
    for _ in range(count):
        xs, ys = [], []
        for _ in range(b):
            if pos + t + 1 > len(tokens):
                pos = 0
            w = tokens[pos : pos + t + 1]
            xs.append(w[:-1])
            ys.append(w[1:])
            pos += t
        out.append((torch.tensor(xs, dtype=torch.int32), torch.tensor(ys, dtype=torch.int32)))
    return out


def fed_batches(twin, path, args):
    """The batches fusec fed, one {input: tensor} per micro-batch in order."""
    stacked = twin.read_safetensors(path)
    meta = read_header(path).get("__metadata__", {})
    n = {t.shape[0] for t in stacked.values()}
    if len(n) != 1:
        raise SystemExit(f"error: {path}: the inputs hold different numbers of batches {sorted(n)}")
    n = n.pop()
    batches = [{k: v[i].clone() for k, v in stacked.items()} for i in range(n)]
    if not args.data.startswith("random"):
        tokens = stacked["tokens"]
        ours = windows(token_file(args.data), tokens.shape[1], tokens.shape[2], n)
        for i, (x, y) in enumerate(ours):
            if not (torch.equal(x, batches[i]["tokens"]) and torch.equal(y, batches[i]["targets"])):
                raise SystemExit(f"error: batch {i + 1}: fusec fed other windows of {args.data} than its documented reader cuts")
        print(f"  {n} batches of {args.data}: the windows fusec fed are the documented ones")
    return batches, int(meta.get("micro_batches", "1"))


def step_batches(batches, micro, step):
    """The micro-batches of step `step` (1-based); `--data random` repeats its one batch."""
    return [batches[((step - 1) * micro + m) % len(batches)] for m in range(micro)]


# ---- the twin's runs ----


def on_device(batch, dev, dtype):
    """A batch's tensors on `dev`, the floating ones in `dtype`."""
    return {k: v.to(dev, dtype) if v.is_floating_point() else v.to(dev) for k, v in batch.items()}


def twin_train(twin, init, batches, micro, args, precision, skip=None):
    """Trains the twin; `precision` is fp64 for the judge. Returns one dict per step."""
    dev = args.device
    model = twin.MODEL()
    twin.load_fusec(model, init)
    wide = precision == "fp64"
    model = model.to(dev, torch.float64 if wide else torch.float32)
    opt = twin.make_optimizer(model, args.lr)
    scaler = None if wide else twin.make_scaler(dev)
    out = []
    for step in range(1, args.steps + 1):
        inputs = []
        for b in step_batches(batches, micro, step):
            inputs.append(on_device(b, dev, torch.float64 if wide else torch.float32))
        if skip and step in skip:
            loss = fp64_loss_only(model, inputs)
            out.append({"loss": loss, "grad_norm": None, "skipped": True})
            continue
        before = scaler.get_scale() if scaler is not None else None
        rate = twin.learning_rate(step, args.steps, args.lr)
        loss, norm = twin.train_step(model, opt, inputs, lr=rate, scaler=scaler, precision=precision,
                                     casting=args.casting)
        skipped = scaler is not None and scaler.get_scale() < before
        out.append({"loss": loss, "grad_norm": norm, "skipped": skipped})
    return out, model


def fp64_loss_only(model, inputs):
    with torch.no_grad():
        return sum(model(**i).item() for i in inputs) / len(inputs)


# ---- judging ----


def probe(args, work, precision, twin, batches, micro, ours, k):
    """Step k's gradient norm at fusec's own weights: fusec trains k - 1
    steps and saves them, and the twin takes step k's gradient there in f64,
    in fp32 and, for a bf16 or fp16 run, in that precision too (rounding as
    --casting says). Where fusec's logged norm is as near the f64 norm at its
    own weights as the same-precision twin's is, a step's excess came from
    the weights' path, not from that step's arithmetic. (A constant learning
    rate keeps the k - 1 steps the same as the full run's.) Returns fusec's
    and the same-precision twin's distances from the f64 norm."""
    ck = os.path.join(work, f"probe_{precision}_{k}.safetensors")
    cmd = [args.fusec, "train", args.model, "--precision", precision, "--data", args.data,
           "--steps", str(k - 1), "--seed", str(args.seed), "--save", ck]
    cmd += model_args(args) + size_args(args)
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if args.cpu:
        cmd.append("--cpu")
    run(cmd + args.fusec_arg, quiet=True)
    norms, losses = {}, {}
    for p in dict.fromkeys(("fp64", "fp32", precision)):
        dt = torch.float64 if p == "fp64" else torch.float32
        model = twin.MODEL()
        twin.load_fusec(model, ck)
        model = model.to(args.device, dt)
        inputs = [on_device(b, args.device, dt) for b in step_batches(batches, micro, k)]
        if p in ("fp64", "fp32"):
            total = 0.0
            for i in inputs:
                loss = model(**i)
                (loss / micro).backward()
                total += loss.item()
            losses[p] = total / micro
            norms[p] = math.sqrt(sum(float((q.grad.double() ** 2).sum()) for q in model.parameters()
                                     if q.grad is not None))
        else:
            # The twin's own step in fusec's precision: the loss and norm it
            # reports are those before clipping and the update.
            opt = twin.make_optimizer(model, args.lr)
            losses[p], norms[p] = twin.train_step(model, opt, inputs, lr=args.lr, scaler=twin.make_scaler(args.device),
                                                  precision=p, casting=args.casting)
    ours_k = ours[k - 1]["grad_norm"]
    same = rel(norms[precision], norms["fp64"])
    head = f"  step {k} at fusec's weights after step {k - 1}: f64 norm {norms['fp64']:.9g}, fp32 twin {rel(norms['fp32'], norms['fp64']):.1e} from it, "
    if precision != "fp32":
        head += f"{precision} twin {same:.1e}, "
    if ours_k is None:
        print(head + "fusec skipped the step (an fp16 overflow)")
        return None
    out = {"step": k}
    coarser, _ = twin_tensors.arithmetic(args, precision)
    for q, ours_q, ref in (("grad_norm", ours_k, norms), ("loss", ours[k - 1]["loss"], losses)):
        d, t = rel(ours_q, ref["fp64"]), rel(ref[precision], ref["fp64"])
        out[q] = {"fusec": d, "twin": t, "allowed": allowance(t, precision, coarser)}
    n, l = out["grad_norm"], out["loss"]
    print(head + f"fusec's logged {ours_k:.9g}, {n['fusec']:.1e} from it ({n['fusec'] / n['allowed']:.2f} of the same "
          f"allowance); loss {l['fusec']:.1e} from the f64 one ({l['fusec'] / l['allowed']:.2f})")
    return out


def weights_report(twin, fusec_final, same_model, wide_model):
    """Each parameter after the last step: its distance from the f64 twin's,
    relative to that tensor's size, for fusec and for the same-precision twin;
    the parameters where fusec is furthest ahead of the twin's distance first."""
    ours = twin.read_safetensors(fusec_final)
    same = dict(same_model.state_dict())
    wide = dict(wide_model.state_dict())
    rows = []
    for name, w in wide.items():
        w = w.detach().double().cpu()
        scale = max(w.norm().item(), 1e-30)
        f = (ours[name].double() - w).norm().item() / scale
        t = (same[name].detach().double().cpu() - w).norm().item() / scale
        rows.append((f / max(t, 1e-30), name, f, t, list(w.shape)))
    rows.sort(reverse=True)
    print("  weights after the last step, distance from the f64 twin's (relative to the tensor):")
    print(f"  {'parameter':<40} {'fusec':>10} {'twin':>10} {'ratio':>8}")
    for ratio, name, f, t, shape in rows[:12]:
        print(f"  {name:<40} {f:10.1e} {t:10.1e} {ratio:8.1f}  {shape}")
    total_f = sum(r[2] for r in rows) / len(rows)
    total_t = sum(r[3] for r in rows) / len(rows)
    print(f"  mean over {len(rows)} tensors: fusec {total_f:.1e}, twin {total_t:.1e}")


def rel(a, b):
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b) / max(abs(b), 1e-300)


def allowance(twin_distance, precision, coarser):
    """SLACK times the same-precision twin's distance, or the precision's
    floor, each scaled by how much coarser fusec's arithmetic is (the floor
    to at most bf16's, as tools/twin_tensors.py scales its own)."""
    floor = min(FLOOR[precision] * coarser, FLOOR["bf16"]) if coarser > 1 else FLOOR[precision]
    return max(SLACK * coarser * (twin_distance or 0.0), floor)


def judge(ours, same, wide, precision, fp16_skips_differ, coarser=1.0):
    """One row per step: fusec's and the same-precision twin's distances from
    the float64 twin, the allowance (scaled by how much coarser fusec's
    arithmetic is), and whether fusec is within it."""
    rows, ok = [], True
    for i, (f, s, w) in enumerate(zip(ours, same, wide), 1):
        row = {"step": i, "fusec_loss": f["loss"], "twin_loss": s["loss"], "f64_loss": w["loss"]}
        for q in ("loss", "grad_norm"):
            if f.get(q) is None and q == "grad_norm":
                continue
            if w[q] is None:
                continue
            d_f, d_t = rel(f[q], w[q]), rel(s[q], w[q])
            allowed = allowance(d_t, precision, coarser)
            good = d_f is not None and d_f <= allowed
            row[q] = {"fusec": d_f, "twin": d_t, "allowed": allowed, "ok": good}
            ok &= good
        rows.append(row)
    if fp16_skips_differ:
        print(f"  note: the fp16 twin skipped steps {fp16_skips_differ[1]}, fusec {fp16_skips_differ[0]}")
    return rows, ok


def show(rows, precision):
    def fmt(x):
        return "-" if x is None else f"{x:.1e}"
    print(f"  {'step':>4} {'fusec loss':>12} {'f64 twin':>12}   {'loss: fusec':>11} {'twin':>8} {'allowed':>8}"
          f"   {'norm: fusec':>11} {'twin':>8} {'allowed':>8}")
    for r in rows:
        bad = any(not r[q]["ok"] for q in ("loss", "grad_norm") if q in r)
        if r["step"] <= 3 or r["step"] % 10 == 0 or bad or r["step"] == len(rows):
            cells = []
            for q in ("loss", "grad_norm"):
                c = r.get(q)
                cells.append("  ".join([f"{fmt(c['fusec']) if c else '-':>11}", f"{fmt(c['twin']) if c else '-':>8}",
                                        f"{fmt(c['allowed']) if c else '-':>8}"]))
            print(f"  {r['step']:>4} {r['fusec_loss']:>12.6f} {r['f64_loss']:>12.6f}   {cells[0]}   {cells[1]}"
                  + ("   << outside" if bad else ""))


def parity(args, work, precision):
    print(f"== {os.path.basename(args.model)} in {precision}")
    twin = export(args, work, precision)
    init, data, ours = fusec_train(args, work, precision)
    if len(ours) != args.steps:
        raise SystemExit(f"error: fusec logged {len(ours)} steps of {args.steps}")
    batches, micro = fed_batches(twin, data, args)
    if micro != twin.MICRO_BATCHES:
        raise SystemExit(f"error: fusec ran {micro} micro-batches a step, the twin {twin.MICRO_BATCHES}")
    fusec_skips = {i for i, s in enumerate(ours, 1) if s["grad_norm"] is None} if precision == "fp16" else set()
    same, same_model = twin_train(twin, init, batches, micro, args, precision)
    wide, wide_model = twin_train(twin, init, batches, micro, args, "fp64", skip=fusec_skips)
    if args.weights:
        weights_report(twin, os.path.join(work, f"final_{precision}.safetensors"), same_model, wide_model)
    probes = {k: probe(args, work, precision, twin, batches, micro, ours, k) for k in args.probe}
    tensors_ok = True
    for k in args.tensors:
        _, good = twin_tensors.tensor_step(args, work, precision, twin, batches, micro, k, run, model_args,
                                           size_args, on_device, step_batches)
        tensors_ok &= good
    twin_skips = {i for i, s in enumerate(same, 1) if s["skipped"]}
    differ = (sorted(fusec_skips), sorted(twin_skips)) if twin_skips != fusec_skips else None
    coarser, math_name = twin_tensors.arithmetic(args, precision)
    if math_name:
        print(f"  fusec multiplies in {math_name} on the GPU, {coarser:g}x coarser than the fp32 twin: "
              f"the allowance and floor below are {coarser:g}x theirs")
    rows, ok = judge(ours, same, wide, precision, differ, coarser)
    show(rows, precision)
    worst = max((r[q]["fusec"] / r[q]["allowed"] for r in rows for q in ("loss", "grad_norm")
                 if q in r and r[q]["fusec"] is not None), default=0.0)
    print(f"  {precision}: {args.steps} steps, fusec's largest distance from the f64 twin is "
          f"{worst:.2f} of its allowance: {'PASS' if ok else 'FAIL'}")
    # A step outside the path's allowance is probed: the same step taken at
    # fusec's own weights by the f64 and same-precision twins says whether
    # that step's arithmetic is off, or only the weights' path has parted.
    outside = [r for r in rows if any(q in r and not r[q]["ok"] for q in ("loss", "grad_norm"))]
    explained, step_worst = ok, None
    if outside:
        if any(r["step"] == 1 for r in outside) or differ is not None:
            explained = False  # step 1 starts from the same weights: nothing parted yet
        else:
            explained = True
            for r in outside:
                k = r["step"]
                if k not in probes:
                    probes[k] = probe(args, work, precision, twin, batches, micro, ours, k)
                got = probes[k]
                if got is None:
                    explained = False
                    continue
                for q in ("loss", "grad_norm"):
                    if q in r and not r[q]["ok"]:
                        share = got[q]["fusec"] / got[q]["allowed"]
                        step_worst = share if step_worst is None else max(step_worst, share)
                        explained &= share <= 1.0
        if step_worst is not None:
            print(f"  {precision}: the {len(outside)} steps outside, taken at fusec's own weights, are at most "
                  f"{step_worst:.2f} of the same allowance from the f64 twin's step: "
                  + ("each step's arithmetic is within it, only the path parted" if explained
                     else "a step's own arithmetic is outside it"))
    # The path rule is the verdict: the probes only say why it failed.
    verdict = "PASS" if ok else "FAIL (path parted; every step outside within at fusec's weights)" if explained else "FAIL"
    if args.tensors:
        verdict += ", tensors PASS" if tensors_ok else ", tensors FAIL"
    return {"precision": precision, "ok": ok and tensors_ok, "tensors_ok": tensors_ok, "path_ok": ok, "worst_share": worst,
            "probed_worst_share": step_worst, "verdict": verdict, "rows": rows,
            "probes": [p for p in probes.values() if p], "fusec_skips": sorted(fusec_skips),
            "twin_skips": sorted(twin_skips)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the model file (.dsl)")
    ap.add_argument("--fusec", default="target/release/fusec")
    ap.add_argument("--data", default="random-stream", help="random-stream (the default: a fresh random batch each step, nothing to memorize), random (one fixed batch), a text file or an llm.c .bin shard")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--fusec-arg", action="append", default=[], metavar="ARG",
                    help="passed to `fusec train` as it is (repeatable), e.g. --fusec-arg=--deterministic")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=N")
    ap.add_argument("--precision", default="both",
                    help="both (fp32 and the model's own; the default), own, fp32, bf16 or fp16")
    ap.add_argument("--lr", type=float, help="learning rate (default: the model file's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe", type=int, action="append", default=[], metavar="K",
                    help="step K's gradient norm at fusec's own weights after step K - 1, in f64, fp32 and the run's precision, beside fusec's logged one (repeatable; 2 <= K <= --steps)")
    ap.add_argument("--tensors", type=int, action="append", default=[], metavar="K",
                    help="step K tensor by tensor from fusec's own weights and state after step K - 1: every "
                         "parameter's gradient and update against the f64 twin's, within 3x the same-precision "
                         "twin's distance or the floor (tools/twin_tensors.py); part of the verdict (repeatable; "
                         "1 <= K <= --steps)")
    ap.add_argument("--weights", action="store_true",
                    help="after the last step, compare every parameter with the f64 twin's, fusec's distance beside the same-precision twin's")
    ap.add_argument("--casting", default="compute", choices=["compute", "autocast"],
                    help="how the bf16/fp16 twin rounds its activations: compute (the default: every "
                         "activation in the compute dtype, as fusec's precision is defined) or autocast "
                         "(torch.autocast, which keeps biases' sums, residual sums and norms in f32)")
    ap.add_argument("--cpu", action="store_true", help="fusec on its CPU reference interpreter (small sizes)")
    ap.add_argument("--device", default=None, help="where the twins run (default: cuda when there is one, else cpu)")
    ap.add_argument("--keep", metavar="DIR", help="keep the twins, weights, batches and logs here")
    ap.add_argument("--out", metavar="FILE", help="write every step's figures here (JSON)")
    args = ap.parse_args()
    bad_t = [k for k in args.tensors if not 1 <= k <= args.steps]
    if bad_t:
        raise SystemExit(f"error: --tensors {bad_t[0]}: a step from 1 to --steps ({args.steps})")
    bad = [k for k in args.probe if not 2 <= k <= args.steps]
    if bad:
        raise SystemExit(f"error: --probe {bad[0]}: a probe needs a step from 2 to --steps ({args.steps})")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda":
        # PyTorch's fp32 reference must not round products to TF32 (fusec does not).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if not os.path.exists(args.fusec):
        raise SystemExit(f"error: no fusec binary at {args.fusec}; build it (cargo build --release) or pass --fusec")
    work = args.keep or tempfile.mkdtemp(prefix="twin-parity-")
    os.makedirs(work, exist_ok=True)
    own = export(args, work, None).PRECISION
    wanted = {"both": ["fp32", own], "own": [own]}.get(args.precision, [args.precision])
    wanted = list(dict.fromkeys(wanted))
    for p in wanted:
        if p not in FLOOR:
            raise SystemExit(f"error: --precision {p}: expected both, own, fp32, bf16 or fp16")
    results = [parity(args, work, p) for p in wanted]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "data": args.data, "steps": args.steps, "results": results}, f, indent=1)
    if not args.keep:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r["ok"] for r in results)
    print(f"{os.path.basename(args.model)}: {', '.join(r['precision'] + ' ' + r['verdict'] for r in results)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
