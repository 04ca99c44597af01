#!/usr/bin/env python3
"""The table at the top of docs/benchmarks.md: where fusec stands, from the
files `tools/gpu_check.sh summary` writes in one device call (its folder is
the first argument). Prints the table; with --insert FILE also puts it
between FILE's summary markers (before its first `## ` heading when it has
none), so the dated log stays below it.

Files read (each optional; a part that did not run is said to be missing):
  gpu.txt                  nvidia-smi's name, memory, driver
  startup.txt              lines `cold SECONDS` / `warm SECONDS`
  fusec-gpt2-bB.json       `fusec bench` of gpt2-small at B (its JSON line)
  torch-gpt2.jsonl         torch_reference.py's lines (mode compiled)
  llmc-bB.txt              llmc.sh's output at B (step lines, device memory)
  llama.jsonl              tools/bench_twins.py --out rows (llama-small)
  attention-fusec.jsonl    fusec bench-attention lines
  attention-torch.jsonl    torch_reference.py --attn-sweep lines
  fusec-gpt2-b8-budget.json  gpt2-small at B = 8 with --memory-budget 4.4GiB
  fusec-gpt2xl-b8.json     `fusec bench` of gpt2-xl at B = 8
  attention-f32-fusec.jsonl, attention-f32-torch.jsonl  the same sweep in f32
"""
import argparse
import json
import os
import re
import statistics

START, END = "<!-- summary:start -->", "<!-- summary:end -->"


def lines(path):
    try:
        with open(path) as f:
            return [l.rstrip("\n") for l in f]
    except OSError:
        return []


def jsonl(path):
    out = []
    for l in lines(path):
        l = l.strip()
        if l.startswith("{"):
            try:
                out.append(json.loads(l))
            except json.JSONDecodeError:
                pass
    return out


def llmc(path):
    """Median ms of llm.c's printed step lines and its device memory (MiB)."""
    ms, mem = [], None
    for l in lines(path):
        m = re.search(r"\|\s*([\d.]+) ms\s*\|", l)
        if l.lstrip().startswith("step") and m:
            ms.append(float(m.group(1)))
        m = re.search(r"device memory usage:\s*(\d+) MiB", l)
        if m:
            mem = int(m.group(1))
    return (statistics.median(ms) if ms else None), mem


def ratio(peer_ms, ours_ms):
    return f"**{peer_ms / ours_ms:.2f}x**" if peer_ms and ours_ms else "-"


def gib(x):
    return "-" if x is None else f"{x:.1f} GiB"


def attention_rows(d, tag, dtype, rows, missing, shown, what):
    """fusec's attention sweep beside SDPA's (attention{tag}-fusec.jsonl,
    attention{tag}-torch.jsonl), each measure written by `shown`."""
    fa = [r for r in jsonl(os.path.join(d, f"attention{tag}-fusec.jsonl")) if r.get("causal", True)]
    ta = [r for r in jsonl(os.path.join(d, f"attention{tag}-torch.jsonl")) if r.get("impl") == "sdpa" and not r.get("oom")]
    for r in fa:
        t = [x for x in ta if x["head_dim"] == r["head_dim"] and x["seq"] == r["seq"]]
        if t:
            t = t[0]
            rows.append((f"attention, causal, {r.get('dtype', dtype)}, D = {r['head_dim']}, T = {r['seq']}, forward + backward",
                         shown(r), f"SDPA {shown(t)}", ratio(t["fwd_bwd_ms"], r["fwd_bwd_ms"]), "-"))
    if not fa:
        missing.append(what)


def table(d, commit, date):
    gpu = (lines(os.path.join(d, "gpu.txt")) or ["an unnamed GPU"])[0].strip()
    rows, missing = [], []
    torch_rows = [r for r in jsonl(os.path.join(d, "torch-gpt2.jsonl")) if r.get("mode") == "compiled"]
    for b in (8, 32):
        f = jsonl(os.path.join(d, f"fusec-gpt2-b{b}.json"))
        f = f[-1] if f else None
        if not f:
            missing.append(f"fusec gpt2-small B={b}")
            continue
        ms, mem = f["ms_per_step"], f.get("peak_memory_gib")
        ours = f"{ms:.1f} ms, {f['tokens_per_s'] / 1e3:.0f}K tok/s, MFU {f.get('mfu', '-')}"
        lm, lmem = llmc(os.path.join(d, f"llmc-b{b}.txt"))
        if lm:
            rows.append((f"gpt2-small, B = {b}, T = 1024", ours, f"llm.c (cuDNN) {lm:.1f} ms",
                         ratio(lm, ms), f"{gib(mem)} / {gib(lmem / 1024 if lmem else None)}"))
        else:
            missing.append(f"llm.c B={b}")
        t = [r for r in torch_rows if r.get("batch") == b]
        if t:
            t = t[-1]
            rows.append((f"gpt2-small, B = {b}, T = 1024", ours, f"torch.compile {t['ms_per_step']:.1f} ms",
                         ratio(t["ms_per_step"], ms), f"{gib(mem)} / {gib(t['peak_mem_mib'] / 1024)} allocated"))
        else:
            missing.append(f"torch.compile B={b}")
    f = jsonl(os.path.join(d, "fusec-gpt2-b8-budget.json"))
    lm, lmem = llmc(os.path.join(d, "llmc-b8.txt"))
    if f and lm:
        f = f[-1]
        rows.append(("gpt2-small, B = 8, T = 1024, `--memory-budget 4.4GiB`",
                     f"{f['ms_per_step']:.1f} ms, MFU {f.get('mfu', '-')}", f"llm.c (cuDNN) {lm:.1f} ms",
                     ratio(lm, f["ms_per_step"]),
                     f"{gib(f.get('peak_memory_gib'))} / {gib(lmem / 1024 if lmem else None)}"))
    elif not f:
        missing.append("gpt2-small B=8 under a memory budget")
    f = jsonl(os.path.join(d, "fusec-gpt2xl-b8.json"))
    if f:
        f = f[-1]
        rows.append(("gpt2-xl, B = 8, T = 1024", f"{f['ms_per_step']:.1f} ms, MFU {f.get('mfu', '-')}",
                     "goal: MFU 0.5", "-", f"{gib(f.get('peak_memory_gib'))} / -"))
    else:
        missing.append("gpt2-xl")
    for r in jsonl(os.path.join(d, "llama.jsonl")):
        f, t = r.get("fusec") or {}, r.get("compiled") or {}
        sizes = ", ".join(f"{k} = {v}" for k, v in r.get("sizes", {}).items())
        if f.get("ms_per_step") and t.get("ms_per_step"):
            rows.append((f"{r['model']}, {sizes}", f"{f['ms_per_step']:.1f} ms",
                         f"its twin under torch.compile {t['ms_per_step']:.1f} ms",
                         ratio(t["ms_per_step"], f["ms_per_step"]),
                         f"{gib(f.get('peak_memory_gib'))} / {gib(t.get('peak_memory_gib'))}"))
    if not any(r[0].startswith("llama") for r in rows):
        missing.append("llama-small")
    attention_rows(d, "", "bf16", rows, missing,
                   lambda r: f"{r['fwd_bwd_tflops']:.0f} TFLOP/s", "attention")
    attention_rows(d, "-f32", "f32", rows, missing,
                   lambda r: f"{r['fwd_bwd_ms']:.2f} ms", "f32 attention")
    starts = {}
    for l in lines(os.path.join(d, "startup.txt")):
        p = l.split()
        if len(p) == 2:
            starts.setdefault(p[0], []).append(float(p[1]))
    for kind, goal in (("warm", 1.0), ("cold", 4.0)):
        s = starts.get(kind)
        if s:
            rows.append((f"start-up, {kind} (gpt2-small to the end of step 1, {len(s)} runs)",
                         f"{min(s):.2f}-{max(s):.2f} s", f"goal: under {goal:g} s", "-", "-"))
        else:
            missing.append(f"{kind} start-up")
    out = [START, "## Where fusec stands", "",
           f"Measured by `tools/gpu_check.sh summary` in one device call on {gpu}, commit {commit}, {date}; "
           "each ratio is the peer's time over fusec's, so above 1 is fusec ahead. The dated entries below are the log.",
           "", "| job | fusec | peer | ratio | memory (fusec / peer) |", "|---|---|---|---|---|"]
    out += [f"| {' | '.join(r)} |" for r in rows]
    if missing:
        out += ["", "Not measured in this call: " + ", ".join(missing) + "."]
    out += [END]
    return "\n".join(out) + "\n"


def insert(path, text):
    with open(path) as f:
        doc = f.read()
    if START in doc and END in doc:
        head, rest = doc.split(START, 1)
        doc = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        at = doc.find("\n## ")
        at = len(doc) if at < 0 else at + 1
        doc = doc[:at] + text + "\n" + doc[at:]
    with open(path, "w") as f:
        f.write(doc)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--date", default="unknown")
    ap.add_argument("--insert", metavar="FILE", help="put the table into FILE (docs/benchmarks.md)")
    args = ap.parse_args()
    text = table(args.folder, args.commit, args.date)
    print(text, end="")
    if args.insert:
        insert(args.insert, text)


if __name__ == "__main__":
    main()
