#!/usr/bin/env python3
"""BERT weights in: a randomly initialised Hugging Face
BertForSequenceClassification, saved with save_pretrained, trained by fusec
from those weights (`--init-from ... --name-map dsl-examples/maps/hf-bert.json`)
on the shipped labelled sentences, padded, with the attention mask in use.
Checks, each printing PASS or FAIL (fp32, dropout off on both sides):

1. the batch's loss at step 1 equals transformers' on the same padded batch
   (its attention_mask from the same lengths), 1e-5 relative;
2. each of four sentences alone (a batch of 1): its loss equals
   transformers' for that row, which for two classes fixes the row's logit
   difference, so a wrong logit cannot hide in the batch mean;
3. the same batch padded to twice the length gives the same loss.

Two sizes: a small one (2 layers, width 64, 3 classes, so the class count
is not BERT's default) and bert-base (12 layers, width 768).

    python3 tools/hf_bert_check.py --fusec out/device/fusec --work /tmp/bert-check
"""
import argparse
import json
import os
import subprocess
import sys

import torch
import transformers
from tokenizers import Tokenizer

DATA = "dsl-examples/data/sentiment.tsv"
TOKENIZER = "dsl-examples/data/tokenizer-sentences.json"
# 1e-5 relative: both sides compute in fp32 (transformers with TF32 off);
# a loss near 0.7 over some 10^2..10^3 fp32 roundings a value lands within
# a few 1e-7 relative, and a wrong weight, mask or activation moves it
# by far more than 1e-5.
TOL = 1e-5
failed = []


def verdict(name, ok, detail):
    print(f"{name}: {detail}: {'PASS' if ok else 'FAIL'}", flush=True)
    if not ok:
        failed.append(name)


def fusec_loss(fusec, ckpt, data, sets, batch, t, work, tag):
    log = os.path.join(work, f"{tag}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [fusec, "train", "dsl-examples/bert-classifier.dsl", "--precision", "fp32", "--batch", str(batch),
           "--dim", f"T={t}", "--steps", "1", "--data", data, "--tokenizer", TOKENIZER,
           "--init-from", ckpt, "--name-map", "dsl-examples/maps/hf-bert.json", "--log", log] + sets
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"$ {' '.join(cmd)}\n{p.stderr[-3000:]}", flush=True)
        return float("nan")
    return json.loads(open(log).readline())["loss"]


def check(fusec, work, name, cfg, rows):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).cuda()
    out = os.path.join(work, name)
    model.save_pretrained(out, safe_serialization=True)
    ckpt = os.path.join(out, "model.safetensors")
    sets = ["--set", f"d={cfg.hidden_size}", "--set", f"layers={cfg.num_hidden_layers}",
            "--set", f"n_heads={cfg.num_attention_heads}", "--set", f"ffn={cfg.intermediate_size}",
            "--set", f"vocab={cfg.vocab_size}", "--set", f"ctx={cfg.max_position_embeddings}",
            "--set", f"classes={cfg.num_labels}", "--set", "p=0"]
    tok = Tokenizer.from_file(TOKENIZER)
    ids = [tok.encode(text).ids for text, _ in rows]
    labels = torch.tensor([label for _, label in rows]).cuda()
    t = 32
    batch = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for r, x in enumerate(ids):
        batch[r, :len(x)] = torch.tensor(x)
        mask[r, :len(x)] = 1
    with torch.no_grad():
        logits = model(input_ids=batch.cuda(), attention_mask=mask.cuda(),
                       token_type_ids=torch.zeros_like(batch).cuda()).logits.double()
    per_row = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    want = per_row.mean().item()
    data = os.path.join(work, f"{name}.tsv")
    with open(data, "w") as f:
        f.writelines(f"{text}\t{label}\n" for text, label in rows)
    got = fusec_loss(fusec, ckpt, data, sets, len(rows), t, work, f"{name}-batch")
    rel = abs(got - want) / abs(want)
    lens = [len(x) for x in ids]
    verdict(f"{name} batch", rel <= TOL,
            f"{len(rows)} sentences of {min(lens)}-{max(lens)} tokens padded to {t}: transformers {want:.8f}, "
            f"fusec {got:.8f}, relative {rel:.1e} (allowed {TOL:.0e})")
    worst = 0.0
    for r in range(4):
        one = os.path.join(work, f"{name}-row{r}.tsv")
        with open(one, "w") as f:
            f.write(f"{rows[r][0]}\t{rows[r][1]}\n")
        got_r = fusec_loss(fusec, ckpt, one, sets, 1, t, work, f"{name}-row{r}")
        worst = max(worst, abs(got_r - per_row[r].item()) / abs(per_row[r].item()))
    verdict(f"{name} rows", worst <= TOL,
            f"four sentences alone against transformers' row losses: worst relative {worst:.1e} (allowed {TOL:.0e})")
    got64 = fusec_loss(fusec, ckpt, data, sets, len(rows), 2 * t, work, f"{name}-pad64")
    rel = abs(got64 - got) / abs(got)
    verdict(f"{name} padding", rel <= TOL,
            f"padded to {2 * t}: {got64:.8f} against {got:.8f} at {t}, relative {rel:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fusec", required=True)
    ap.add_argument("--work", default="/tmp/bert-check")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for line in open(DATA):
        text, label = line.rstrip("\n").split("\t")
        rows.append((text, int(label)))
        if len(rows) == 8:
            break
    common = dict(vocab_size=800, max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu",
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
    small = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, num_labels=3, **common)
    base = transformers.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                   intermediate_size=3072, num_labels=2, **common)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    check(a.fusec, a.work, "small", small, rows)
    check(a.fusec, a.work, "bert-base", base, rows)
    print("FAILED: " + ", ".join(failed) if failed else "all PASS")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
