#!/usr/bin/env python3
"""Decoding speed: `fusec generate` beside transformers' `generate`, on the
same random weights, greedy, bf16, one table.

    python3 tools/bench_generate.py --fusec out/device/fusec [--new 256] [--batches 1 32]

For gpt2-small and llama-small (dsl-examples/, their Hugging Face twins
GPT2LMHeadModel and LlamaForCausalLM with grouped-query heads), the
weights transformers draws (seed 0) are saved and read by fusec through
the shipped name maps. Each batch size continues an 8-token prompt (the
same prompt in every row) by --new tokens, no end-of-text stop:

- fusec: `fusec generate --batch B`, its own last line's tokens/s (the
  decode loop, after the kernels are compiled and the step captured);
- transformers, `cache_implementation="static"`, with which `generate`
  compiles the forward pass itself (its default `CompileConfig`:
  torch.compile, fullgraph, mode "reduce-overhead": CUDA graphs), after two
  warm-up calls, the median of GEN_REPEATS (default 3) timed `generate`
  calls; the graphs dynamo compiled are counted, so a run that did not
  compile says so;
- transformers, eager with its default dynamic cache, after one warm-up
  call, the same way.

Tokens/s counts new tokens over every row. The ratio is fusec's tokens/s
over the compiled transformers': above 1, fusec is faster. Prints a
markdown table and, with --out, JSON lines.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPEATS = int(os.environ.get("GEN_REPEATS", "3"))
PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931]

MODELS = {
    "gpt2-small": ("dsl-examples/gpt2-small.dsl", "dsl-examples/maps/hf-gpt2.json"),
    "llama-small": ("dsl-examples/llama-small.dsl", "dsl-examples/maps/hf-llama.json"),
}


def hf_model(name):
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "gpt2-small":
        cfg = transformers.GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                                      layer_norm_epsilon=1e-5, activation_function="gelu_new",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                   num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=3,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                   max_position_embeddings=2048, attention_dropout=0.0)
    return transformers.LlamaForCausalLM(cfg)


def time_hf(model, batch, new, compiled):
    import torch

    prompt = torch.tensor([PROMPT] * batch, device="cuda")
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(prompt))
    if compiled:
        kwargs["cache_implementation"] = "static"
    times = []
    # Compiling takes the first two calls; eager needs one to warm up.
    warm = 2 if compiled else 1
    for i in range(warm + REPEATS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, **kwargs)
        torch.cuda.synchronize()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    assert out.shape[1] == len(PROMPT) + new, out.shape
    return batch * new / statistics.median(times)


def run_fusec(fusec, name, weights, batch, new):
    dsl, names = MODELS[name]
    cmd = [fusec, "generate", dsl, "--weights", weights, "--name-map", names,
           "--prompt-ids", ",".join(map(str, PROMPT)), "--num-samples", str(batch),
           "--batch", str(batch), "--max-new-tokens", str(new), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stderr}")
    last = r.stderr.strip().splitlines()[-1]
    m = re.search(r"\(([0-9.]+) tokens/s, (\d+) steps of batch (\d+), ([0-9.]+) ms a step\)", last)
    if not m:
        raise RuntimeError(f"no tokens/s in: {last}")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == batch and all(len(json.loads(l)["ids"]) == new for l in lines), r.stdout[:500]
    return float(m.group(1)), float(m.group(4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fusec", required=True)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--work", default="/tmp/fusec-bench-generate")
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch
    import transformers

    rows = []
    for name in args.models:
        model = hf_model(name).eval()
        path = os.path.join(args.work, name)
        model.save_pretrained(path, safe_serialization=True)
        weights = os.path.join(path, "model.safetensors")
        model = model.to("cuda", torch.bfloat16)
        model.generation_config.eos_token_id = None
        for batch in args.batches:
            fusec_tps, step_ms = run_fusec(args.fusec, name, weights, batch, args.new)
            eager = time_hf(model, batch, args.new, compiled=False)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            try:
                static = time_hf(model, batch, args.new, compiled=True)
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                note = "" if graphs > 0 else "static cache ran without compiling (no dynamo graph)"
            except Exception as e:  # said in the table, not hidden
                static, note = float("nan"), f"compile failed: {type(e).__name__}: {str(e)[:120]}"
            finally:
                torch._dynamo.reset()
            row = dict(model=name, batch=batch, new=args.new, fusec_tokens_per_s=fusec_tps,
                       fusec_ms_per_step=step_ms, hf_static_compiled_tokens_per_s=static,
                       hf_eager_tokens_per_s=eager, ratio=fusec_tps / static if static == static else None,
                       note=note, torch=torch.__version__, transformers=transformers.__version__,
                       device=torch.cuda.get_device_name())
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| model | batch | fusec tokens/s (ms a step) | transformers static cache + compile | transformers eager | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"**{r['ratio']:.2f}x**" if r["ratio"] else ""
        ratio = f"{ratio} {r['note']}".strip()
        print(f"| {r['model']} | {r['batch']} | {r['fusec_tokens_per_s']:.0f} ({r['fusec_ms_per_step']:.2f}) | "
              f"{r['hf_static_compiled_tokens_per_s']:.0f} | {r['hf_eager_tokens_per_s']:.0f} | {ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
