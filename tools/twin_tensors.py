"""Step K tensor by tensor, for tools/twin_parity.py --tensors K.

fusec takes step K from its own weights and optimizer state after step
K - 1 (`--resume` of its checkpoint; step 1 from its initial weights) and
writes that step's gradients (`--save-grads`) and weights after it
(`--save`). The twin takes the same step from the same weights, state and
batch in float64 (the judge), in fp32 and in the run's precision. Each
parameter's gradient, and its update (new minus old weights), is compared
with the f64 twin's by relative L2 distance and by the largest difference
over the largest value. fusec passes where each distance is within SLACK
times the same-precision twin's own distance, or the precision's floor,
whichever is larger.

On the GPU fusec's fp32 multiplies in 3xTF32 (or TF32 with --tf32): the
allowance and the floor scale by how much coarser that arithmetic is (see
`arithmetic`).

The floors: 1e-4 in fp32 (f32 rounding leaves a gradient 1e-7 to 1e-5 from
the f64 one; a 1% error in one tensor, a sign, a transpose, a swap of two
same-shaped tensors are 1e-2 or more), 1e-3 in bf16 and fp16 (below their
rounding: there the twin's own distance decides). A tensor whose f64
gradient is below 1e-3 of the largest tensor's norm (one that cancels, as a
key bias's does) is measured against that instead of its own norm: its
value is rounding noise on both sides. An Adam update is compared over the
entries whose gradient is clear of the precision's rounding (above 2^-20,
2^-6, 2^-9 of the tensor's largest in fp32, bf16, fp16, above twice the
same-precision twin's largest error in that gradient, and 100 eps): at
step 1 Adam moves every entry by lr sign(g), so an entry near zero moves by
lr one way or the other on every side, fusec's and the twin's alike. A step
fusec skipped for an fp16 overflow is not judged.
"""

import json
import math
import os

import torch

SLACK = 3.0
FLOOR = {"fp32": 1e-4, "bf16": 1e-3, "fp16": 1e-3}


def arithmetic(args, precision):
    """How much coarser fusec's f32 arithmetic is than the fp32 twin's, and
    its name. On the CPU it is f32. On the GPU an fp32 model multiplies in
    3xTF32 (each operand split into two TF32 parts, 22 of f32's 24
    significand bits, the low-by-low product dropped: a unit roundoff near
    2^-21 against f32's 2^-24, so 8x): the attention always, the GEMMs
    unless --exact-f32; --tf32 is one TF32 product (2^-11: 2^13 x). The
    allowance and the floor scale by it (the floor to at most bf16's 1e-3,
    still under a 1% error)."""
    if precision != "fp32" or args.cpu:
        return 1.0, None
    if "--tf32" in args.fusec_arg:
        return 2.0 ** 13, "TF32"
    return 8.0, "3xTF32"
CANCELS = 1e-3


def load_state(twin, model, opt, path, step):
    """fusec's optimizer state after `step` steps (`<param>.adam_m`,
    `.adam_v` or `.momentum` in its checkpoint) into the torch optimizer."""
    if step == 0:
        return
    found = twin.read_safetensors(path)
    for name, p in model.named_parameters():
        st = opt.state[p]
        if f"{name}.adam_m" in found:
            # A fused AdamW (the twin's on the GPU) keeps its step count
            # on the parameters' device; the others keep it on the CPU.
            fused = any(g.get("fused") for g in opt.param_groups)
            st["step"] = torch.tensor(float(step), device=p.device if fused else "cpu")
            st["exp_avg"] = found[f"{name}.adam_m"].to(p.device, p.dtype).reshape(p.shape).clone()
            st["exp_avg_sq"] = found[f"{name}.adam_v"].to(p.device, p.dtype).reshape(p.shape).clone()
        elif f"{name}.momentum" in found:
            st["momentum_buffer"] = found[f"{name}.momentum"].to(p.device, p.dtype).reshape(p.shape).clone()


def twin_step(twin, start, args, precision, k, rate, inputs_of):
    """The twin's step k from `start` in `precision`: (gradients before
    clipping, weights after), by parameter name, as f64 on the CPU."""
    dt = torch.float64 if precision == "fp64" else torch.float32
    model = twin.MODEL()
    twin.load_fusec(model, start)
    model = model.to(args.device, dt)
    opt = twin.make_optimizer(model, args.lr)
    load_state(twin, model, opt, start, k - 1)
    grads = {}
    clip = torch.nn.utils.clip_grad_norm_

    def capture(params, max_norm, *a, **kw):
        # train_step clips after the backward (and the fp16 unscale): the
        # gradients here are those the optimizer is given, before clipping.
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.detach().double().cpu().clone()
        return clip(params, max_norm, *a, **kw)

    torch.nn.utils.clip_grad_norm_ = capture
    try:
        scaler = None if precision == "fp64" else twin.make_scaler(args.device)
        twin.train_step(model, opt, inputs_of(dt), lr=rate, scaler=scaler, precision=precision,
                        casting=args.casting)
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    weights = {n: p.detach().double().cpu().clone() for n, p in model.named_parameters()}
    return grads, weights


# A gradient entry's rounding, as a share of its tensor's largest entry: a
# few units of the precision's roundoff (the sums behind a gradient add
# more): entries below it are noise for the update's sign.
NOISE = {"fp32": 2.0 ** -20, "bf16": 2.0 ** -6, "fp16": 2.0 ** -9}


def conditioned(g64, g_same, precision):
    """The entries of a gradient whose Adam step its rounding cannot flip
    (None for SGD, whose step is the gradient's own size): above the
    precision's roundoff of the tensor's largest entry, and above twice the
    largest error the same-precision twin's gradient of this tensor has (a
    sign the twin itself would not get right is a coin toss for anyone)."""
    if OPTIMIZER_KIND.get("kind") != "adamw":
        return None
    top = g64.abs().max().item()
    twin_error = (g_same - g64).abs().max().item()
    return g64.abs() > max(NOISE[precision] * top, 2.0 * twin_error, 100.0 * OPTIMIZER_KIND.get("eps", 0.0))


# The twin's optimizer (set by tensor_step from the twin module).
OPTIMIZER_KIND = {}


def distances(x, ref, floor_norm):
    """(relative L2, largest difference over largest value) of x from ref."""
    d = x - ref
    norm = max(ref.norm().item(), floor_norm)
    top = max(ref.abs().max().item(), floor_norm / math.sqrt(max(ref.numel(), 1)))
    return d.norm().item() / norm, d.abs().max().item() / top


def judge(name, ours, same, wide, floor, largest, coarser=1.0):
    """One tensor: fusec's and the twin's distances from the f64 value, the
    allowances (SLACK times the twin's, times how much coarser fusec's
    arithmetic is), and whether fusec is within them."""
    cut = CANCELS * largest
    f = distances(ours, wide, cut)
    t = distances(same, wide, cut)
    allowed = tuple(max(floor, SLACK * coarser * x) for x in t)
    ok = all(a <= b for a, b in zip(f, allowed))
    return {"tensor": name, "fusec": f, "twin": t, "allowed": allowed, "ok": ok,
            "share": max(a / b for a, b in zip(f, allowed))}


def tensor_step(args, work, precision, twin, batches, micro, k, run, model_args, size_args, on_device, step_batches):
    """Step k, tensor by tensor (see the module doc). Returns the rows and
    whether every tensor of both kinds is within its allowance."""
    tag = f"{precision}_{k}"
    before = os.path.join(work, f"tensors_before_{tag}.safetensors")
    after = os.path.join(work, f"tensors_after_{tag}.safetensors")
    grads_file = os.path.join(work, f"tensors_grads_{tag}.safetensors")
    # The schedule as the whole run has it (a decay ends at --steps, not
    # at the end of these short runs).
    base = [args.fusec, "train", args.model, "--precision", precision, "--data", args.data,
            "--seed", str(args.seed), "--decay-steps", str(args.steps)] + model_args(args) + size_args(args)
    if args.lr is not None:
        base += ["--lr", str(args.lr)]
    if args.cpu:
        base.append("--cpu")
    log = os.path.join(work, f"tensors_{tag}.jsonl")
    last = ["--save", after, "--save-grads", grads_file, "--log", log] + args.fusec_arg
    if k == 1:
        run(base + ["--steps", "1", "--save-init", before] + last, quiet=True)
    else:
        # --steps counts from the resumed step: one more, step k.
        run(base + ["--steps", str(k - 1), "--save", before] + args.fusec_arg, quiet=True)
        run(base + ["--steps", "1", "--resume", before] + last, quiet=True)
    # The rate fusec took step k at (its schedule, whatever it is).
    logged = [json.loads(line) for line in open(log)][-1]
    rate = logged["lr"]
    if logged.get("grad_norm") is None and precision == "fp16":
        # An fp16 overflow: fusec skipped the step (its gradients are not
        # finite), as the twin's loss scaler would; nothing to compare.
        print(f"  step {k}: fusec skipped it for an fp16 overflow (loss scale halved); not judged tensor by tensor")
        return [], True
    OPTIMIZER_KIND.clear()
    OPTIMIZER_KIND.update(twin.OPTIMIZER)
    ours_g = {n: t.double() for n, t in twin.read_safetensors(grads_file).items()}
    ours_w = {n: t.double() for n, t in twin.read_safetensors(after).items()}
    start_w = {n: t.double() for n, t in twin.read_safetensors(before).items()}

    def inputs_of(dt):
        return [on_device(b, args.device, dt) for b in step_batches(batches, micro, k)]

    wide_g, wide_w = twin_step(twin, before, args, "fp64", k, rate, inputs_of)
    same_g, same_w = twin_step(twin, before, args, precision, k, rate, inputs_of)
    coarser, math_name = arithmetic(args, precision)
    floor = min(FLOOR[precision] * coarser, FLOOR["bf16"])
    rows = []
    largest_g = max(g.norm().item() for g in wide_g.values())
    steps = {n: wide_w[n] - start_w[n].reshape(wide_w[n].shape) for n in wide_w}
    largest_s = max(s.norm().item() for s in steps.values())
    if largest_g == 0.0:
        raise SystemExit(f"error: step {k}: every f64 gradient is zero; nothing to judge")
    for name in wide_g:
        shape = list(wide_g[name].shape)
        if name not in ours_g:
            raise SystemExit(f"error: fusec's --save-grads has no `{name}`")
        r = judge(name, ours_g[name].reshape(shape), same_g[name], wide_g[name], floor, largest_g, coarser)
        r["kind"] = "gradient"
        rows.append(r)
        if largest_s == 0.0:
            continue  # a rate of 0 (a schedule's end): no update to judge
        # Adam moves an entry by about lr g / (|g| + eps): where the
        # gradient is within the precision's rounding of zero its sign, and
        # so its step, is a coin toss on every side (step 1 most of all).
        # Those entries are left out of the update's comparison.
        keep = conditioned(wide_g[name], same_g[name], precision)
        if keep is not None and not bool(keep.any()):
            continue
        ours_s = ours_w[name].reshape(shape) - start_w[name].reshape(shape)
        same_s = same_w[name] - start_w[name].reshape(shape)
        wide_s = steps[name].reshape(shape)
        if keep is not None:
            ours_s, same_s, wide_s = ours_s[keep], same_s[keep], wide_s[keep]
        r = judge(name, ours_s, same_s, wide_s, floor, largest_s, coarser)
        r["kind"] = "update"
        rows.append(r)
    rows.sort(key=lambda r: -r["share"])
    ok = all(r["ok"] for r in rows)
    print(f"  step {k} tensor by tensor, from fusec's weights and state after step {k - 1} "
          f"(distance from the f64 twin: relative L2 / largest difference; allowance {SLACK:g}x the "
          f"{precision} twin's or {floor:g}"
          + (f"; fusec multiplies in {math_name}, {coarser:g}x coarser than f32, which scales both" if math_name else "")
          + "):")
    print(f"  {'parameter':<36} {'':<8} {'fusec':>17} {'twin':>17} {'share':>6}")
    for r in rows[:12] + [r for r in rows[12:] if not r["ok"]]:
        print(f"  {r['tensor']:<36} {r['kind']:<8} {r['fusec'][0]:8.1e} {r['fusec'][1]:8.1e} "
              f"{r['twin'][0]:8.1e} {r['twin'][1]:8.1e} {r['share']:6.2f}" + ("" if r["ok"] else "  << outside"))
    print(f"  {precision}: step {k}, {len(wide_g)} tensors' gradients and updates: "
          f"at most {rows[0]['share']:.2f} of the allowance: {'PASS' if ok else 'FAIL'}")
    return rows, ok
