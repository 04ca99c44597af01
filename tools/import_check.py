#!/usr/bin/env python3
"""Issue checks of the training-run features that need the GPU machine's
Python packages or its GPU, each printing PASS or FAIL:

1. Pretrained weights: a randomly initialised GPT2LMHeadModel and a small
   LlamaForCausalLM (tools/hf_reference.py, save_pretrained) load through the
   shipped name maps, and fusec's first loss on the GPU (fp32) equals
   transformers' on the same tokens within 1e-5 relative.
2. Tokenizer: `fusec tokenize` with the shipped tokenizer.json over a few MB
   of the Python standard library gives the same ids as the Python
   `tokenizers` package.
3. Validation: `fusec train --val-data` on the GPU against the CPU reference,
   the same run (fp32 within 1e-4 relative, bf16 within 2e-2).

    python3 tools/import_check.py --fusec out/device/fusec --work /tmp/import-check
"""
import argparse
import json
import os
import subprocess
import sys
import sysconfig

TEXT = "dsl-examples/data/founding-texts.txt"
GPT2_SETS = ["--set", "layers=2", "--set", "d=64", "--set", "n_heads=4", "--set", "vocab=256", "--set", "ctx=64"]
LLAMA_SETS = ["--set", "layers=2", "--set", "d=64", "--set", "n_heads=4", "--set", "n_kv_heads=2",
              "--set", "ffn=128", "--set", "vocab=256"]
failed = []


def verdict(name, ok, detail):
    print(f"{name}: {detail}: {'PASS' if ok else 'FAIL'}", flush=True)
    if not ok:
        failed.append(name)


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"$ {' '.join(cmd)}\n{p.stderr[-3000:]}", flush=True)
    return p


def log_rows(path):
    try:
        return [json.loads(l) for l in open(path)]
    except OSError:
        return []


def weights(fusec, work):
    for kind, model, sets, windows in (("gpt2", "dsl-examples/gpt2-small.dsl", GPT2_SETS, 1),
                                       ("llama", "dsl-examples/llama-small.dsl", LLAMA_SETS, 2)):
        out = os.path.join(work, f"hf-{kind}")
        p = run([sys.executable, "tools/hf_reference.py", kind, out, TEXT, "32", str(windows)])
        if p.returncode != 0:
            verdict(f"weights {kind}", False, "tools/hf_reference.py failed")
            continue
        ref = json.loads(p.stdout.strip().splitlines()[-1])
        got = {}
        for where in ("gpu", "cpu"):
            log = os.path.join(work, f"{kind}-{where}.jsonl")
            cmd = [fusec, "train", model, "--precision", "fp32", "--batch", "1", "--seq", "32", "--steps", "1",
                   "--data", TEXT, "--init-from", os.path.join(out, "model.safetensors"),
                   "--name-map", f"dsl-examples/maps/hf-{kind}.json", "--log", log] + sets
            if where == "cpu":
                cmd.append("--cpu")
            run(cmd)
            rows = log_rows(log)
            got[where] = rows[0]["loss"] if rows else float("nan")
        rel = abs(got["gpu"] - ref["loss"]) / abs(ref["loss"])
        verdict(f"weights {kind}", rel <= 1e-5,
                f"transformers {ref['transformers']} loss {ref['loss']:.7f}, fusec on the GPU {got['gpu']:.7f} "
                f"(CPU {got['cpu']:.7f}), relative {rel:.1e} (allowed 1e-5)")


def tokens(fusec, work):
    try:
        from tokenizers import Tokenizer
        import tokenizers
    except ImportError:
        verdict("tokenizer", False, "the Python tokenizers package is not installed here")
        return
    lib = sysconfig.get_paths()["stdlib"]
    files = []
    for sub in ("email", "json", "asyncio", "unittest", "xml", "http", "multiprocessing"):
        for root, _, names in os.walk(os.path.join(lib, sub)):
            for n in names:
                if n.endswith(".py"):
                    p = os.path.join(root, n)
                    try:
                        open(p, encoding="utf-8").read()
                        files.append(p)
                    except (UnicodeDecodeError, OSError):
                        pass
    files.sort()
    tj = "dsl-examples/data/tokenizer-512.json"
    out = os.path.join(work, "shards")
    p = run([fusec, "tokenize", "--tokenizer", tj, "-o", out, "--val-fraction", "0"] + files)
    if p.returncode != 0:
        verdict("tokenizer", False, "fusec tokenize failed")
        return
    ids = []
    for name in sorted(os.listdir(out)):
        data = open(os.path.join(out, name), "rb").read()
        # llm.c shards: 256 int32 of header (magic, version, count), then uint16 ids.
        count = int.from_bytes(data[8:12], "little")
        body = data[1024:1024 + 2 * count]
        ids.extend(int.from_bytes(body[i:i + 2], "little") for i in range(0, len(body), 2))
    t = Tokenizer.from_file(tj)
    eot = t.token_to_id("<|endoftext|>")
    theirs = []
    for f in files:
        theirs.append(eot)
        theirs.extend(t.encode(open(f, encoding="utf-8").read(), add_special_tokens=False).ids)
    size = sum(os.path.getsize(f) for f in files)
    first = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), None)
    verdict("tokenizer", len(ids) == len(theirs) and first is None,
            f"{len(files)} files, {size} bytes: fusec {len(ids)} ids, Python tokenizers {tokenizers.__version__} "
            f"{len(theirs)} ids, first difference at {first}")


def validation(fusec, work):
    sets = ["--set", "vocab=256", "--set", "layers=2", "--set", "d=64", "--set", "n_heads=4", "--set", "ctx=64"]
    for prec, tol in (("fp32", 1e-4), ("bf16", 2e-2)):
        vals = {}
        for where in ("gpu", "cpu"):
            log = os.path.join(work, f"val-{prec}-{where}.jsonl")
            cmd = [fusec, "train", "dsl-examples/gpt2-small.dsl", "--precision", prec, "--data", TEXT,
                   "--batch", "4", "--seq", "32", "--steps", "6", "--val-data", "README.md", "--eval-every", "3",
                   "--eval-batches", "4", "--log", log] + sets
            if where == "cpu":
                cmd.append("--cpu")
            run(cmd)
            vals[where] = [(r["step"], r["val_loss"]) for r in log_rows(log) if "val_loss" in r]
        g, c = vals["gpu"], vals["cpu"]
        ok = len(g) == 2 and [s for s, _ in g] == [s for s, _ in c]
        rel = max((abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(g, c)), default=float("nan"))
        verdict(f"validation {prec}", ok and rel <= tol,
                f"val losses at steps {[s for s, _ in g]}: GPU {[round(v, 6) for _, v in g]}, "
                f"CPU reference {[round(v, 6) for _, v in c]}, worst relative {rel:.1e} (allowed {tol:.0e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fusec", required=True)
    ap.add_argument("--work", default="/tmp/import-check")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    weights(a.fusec, a.work)
    tokens(a.fusec, a.work)
    validation(a.fusec, a.work)
    print("all PASS" if not failed else f"FAILED: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


main()
