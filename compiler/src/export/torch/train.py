

# ---- one training step as `fusec train` runs it ----


def make_optimizer(model, lr=None):
    """The `train` section's optimizer. As fusec does, weight decay goes to
    parameters of rank 2 or more and not to vectors and scalars."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    o = dict(OPTIMIZER)
    lr = o["lr"] if lr is None else lr
    if o["kind"] == "adamw":
        fused = all(p.is_cuda for p in params)
        return torch.optim.AdamW(
            groups, lr=lr, betas=o["betas"], eps=o["eps"], weight_decay=o["weight_decay"],
            fused=fused or None,
        )
    return torch.optim.SGD(groups, lr=lr, momentum=o["momentum"], weight_decay=o["weight_decay"])


def learning_rate(step, last_step, lr=None):
    """The rate of step `step` (counted from 1) as fusec's schedule gives it:
    a linear warmup to lr at step `warmup`, then lr (constant), lr *
    sqrt(warmup / step) (inverse_sqrt), or a cosine or linear decay from lr
    at the next step to `min_lr` at step `steps` (the run's `last_step` when
    the model file names none)."""
    s = SCHEDULE
    lr = OPTIMIZER["lr"] if lr is None else lr
    if step <= s["warmup"]:
        return lr * step / s["warmup"]
    if s["kind"] == "constant":
        return lr
    if s["kind"] == "inverse_sqrt":
        return lr * math.sqrt(max(s["warmup"], 1) / step)
    end = s["steps"] or last_step
    if step >= end:
        return s["min_lr"]
    ratio = (step - s["warmup"] - 1) / (end - s["warmup"] - 1)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) if s["kind"] == "cosine" else 1.0 - ratio
    return s["min_lr"] + coeff * (lr - s["min_lr"])


def make_scaler(device):
    """fp16's dynamic loss scale, as fusec keeps it: 65,536 to start, halved on
    an overflow (the step is skipped), doubled after 2,000 good steps."""
    if PRECISION != "fp16":
        return None
    return torch.amp.GradScaler(device, init_scale=65536.0, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=2000)


def autocast_dtype(dtype):
    """The compute dtype under autocast, or None for a run in the parameters' own dtype."""
    if dtype == "fp32" or dtype == "fp64":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


# How a bf16 or fp16 step rounds its activations:
#   "autocast": torch.autocast over the f32 model, as PyTorch code is written
#     (matmuls and attention in the compute dtype, but a bias added to a
#     matmul's output, the residual sums and the norms in f32);
#   "compute": every activation in the compute dtype, as fusec runs it: each
#     parameter converted once where it is used, float inputs converted, and
#     the cross-entropy reading the logits in the compute dtype and working
#     in f32 (fusec's cross_entropy returns f32).
CASTINGS = ("autocast", "compute")


def _forward_in(model, inputs, cast):
    """The loss with every parameter and float input in `cast` (the "compute" casting)."""
    params = {name: p.to(cast) for name, p in model.named_parameters()}
    inputs = {k: v.to(cast) if v.is_floating_point() else v for k, v in inputs.items()}
    cross_entropy = F.cross_entropy

    def f32_cross_entropy(x, *args, **kwargs):
        return cross_entropy(x.float(), *args, **kwargs)

    F.cross_entropy = f32_cross_entropy
    try:
        return torch.func.functional_call(model, params, args=(), kwargs=inputs)
    finally:
        F.cross_entropy = cross_entropy


def train_step(model, opt, micro_batches, lr=None, scaler=None, precision=None, casting="autocast"):
    """One optimizer step over MICRO_BATCHES micro-batches (a list of input
    dicts). Returns (mean loss, gradient norm before clipping) as floats."""
    loss, norm = train_step_tensors(model, opt, micro_batches, lr, scaler, precision, casting=casting)
    return loss.item(), norm.item()


def train_step_tensors(model, opt, micro_batches, lr=None, scaler=None, precision=None, norm=True, casting="autocast"):
    """`train_step` with the loss and norm left on the device as tensors, so
    that a timed loop waits for nothing between steps. With `norm=False` and
    no clipping the norm is not computed (None), as fusec does not. `casting`
    is one of CASTINGS (it matters only in bf16 and fp16)."""
    precision = precision or PRECISION
    if casting not in CASTINGS:
        raise SystemExit(f"error: casting `{casting}`: expected one of {', '.join(CASTINGS)}")
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = lr
    device = next(model.parameters()).device.type
    cast = autocast_dtype(precision)
    total = 0.0
    for inputs in micro_batches:
        if cast is not None and casting == "compute":
            loss = _forward_in(model, inputs, cast)
        else:
            with torch.autocast(device, dtype=cast or torch.float32, enabled=cast is not None):
                loss = model(**inputs)
        # fusec scales each gradient by 1/N, which is the gradient of the mean loss.
        scaled = loss / len(micro_batches)
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total = total + loss.detach()
    if scaler is not None:
        scaler.unscale_(opt)
    total_norm = None
    if norm or CLIP_GRAD_NORM is not None:
        max_norm = CLIP_GRAD_NORM if CLIP_GRAD_NORM is not None else float("inf")
        total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return total / len(micro_batches), total_norm


# ---- inputs and weights ----


def random_inputs(sizes, device="cpu", dtype=torch.float32, generator=None):
    """Random inputs of the model's shapes; `sizes` gives each dimension, e.g. {"B": 2, "T": 16}."""
    out = {}
    for name, (dt, shape, high) in INPUTS.items():
        shape = [sizes[d] if isinstance(d, str) else d for d in shape]
        if dt == "i32":
            out[name] = torch.randint(0, high or 2, shape, generator=generator, dtype=torch.int32).to(device)
        else:
            out[name] = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    return out


_DTYPES = {"F32": (torch.float32, 4), "F64": (torch.float64, 8), "BF16": (torch.bfloat16, 2),
           "F16": (torch.float16, 2), "I32": (torch.int32, 4), "I64": (torch.int64, 8)}


def read_safetensors(path):
    """{name: tensor} from a safetensors file (the format is a JSON header and raw bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise SystemExit(f"error: {path}: tensor `{name}` has dtype {info['dtype']}, which this twin cannot read")
        dtype, _ = _DTYPES[info["dtype"]]
        lo, hi = info["data_offsets"]
        buf = bytearray(data[8 + n + lo : 8 + n + hi])
        out[name] = torch.frombuffer(buf, dtype=dtype).reshape(info["shape"]) if buf else torch.zeros(info["shape"], dtype=dtype)
    return out


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} as safetensors, in f32 (what `fusec train` reads)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_fusec(model, path):
    """Loads the parameters of a fusec checkpoint or `--save-init` file by name
    (optimizer state in the file is left alone). Every parameter must be there, with its shape."""
    found = read_safetensors(path)
    state = model.state_dict()
    for name, p in state.items():
        if name not in found:
            raise SystemExit(f"error: {path} has no tensor `{name}`; it was saved from another model (or other --set values)")
        t = found[name]
        if tuple(t.shape) != tuple(p.shape):
            raise SystemExit(f"error: {path}: tensor `{name}` is {list(t.shape)}, the model's parameter is {list(p.shape)}")
        if not t.dtype.is_floating_point:
            raise SystemExit(f"error: {path}: tensor `{name}` is {t.dtype}, expected a floating-point tensor")
        with torch.no_grad():
            p.copy_(t)


def save_fusec(model, path):
    """The parameters as f32 safetensors under fusec's names (`fusec train --resume` reads them)."""
    write_safetensors(path, dict(model.state_dict()), {"format": "fusec", "model": FUSEC_MODEL})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="size of a dimension (default 2 for each)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--init", help="start from these weights (fusec --save-init or a checkpoint)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--casting", default="autocast", choices=CASTINGS,
                    help="in bf16/fp16: autocast (PyTorch's usual mixed precision) or compute (every activation in the compute dtype, as fusec)")
    args = ap.parse_args()
    sizes = {d: 2 for d in DIMS}
    for kv in args.dim:
        k, _, v = kv.partition("=")
        if k not in sizes:
            raise SystemExit(f"error: --dim {k}: the model has no dimension `{k}`; its dimensions are: {', '.join(DIMS) or 'none'}")
        sizes[k] = int(v)
    torch.manual_seed(args.seed)
    model = MODEL().to(args.device)
    if args.init:
        load_fusec(model, args.init)
    opt = make_optimizer(model)
    scaler = make_scaler(args.device)
    for step in range(1, args.steps + 1):
        batches = [random_inputs(sizes, args.device) for _ in range(MICRO_BATCHES)]
        loss, norm = train_step(model, opt, batches, lr=learning_rate(step, args.steps), scaler=scaler, casting=args.casting)
        print(f"step {step}: loss {loss:.6f}, grad norm {norm:.4f}")


if __name__ == "__main__":
    main()
