#!/usr/bin/env python3
"""A randomly initialised Hugging Face model saved with save_pretrained, and
its mean loss over the first K windows of a text file, as fusec's reader
cuts them (window k: tokens = bytes[kT : kT+T], targets one byte on). For
checking fusec's name maps (dsl-examples/maps): `fusec train --init-from
DIR/model.safetensors --name-map MAP --data TEXT --batch 1 --seq T --steps
1` with K micro-batches must report this loss at step 1.

    python3 tools/hf_reference.py gpt2|llama OUT_DIR TEXT T [K [NEW]]  -> prints {"loss": ...}

With NEW, also "prompts" and "generated": three prompts (the text's bytes,
newlines as spaces, T, T - 5 and T - 11 long, from consecutive windows)
and the NEW token ids `generate(do_sample=False)` continues each with
(greedy, fp32, one prompt at a time), for checking `fusec generate`. The
model then has 160 positions (64 otherwise), room for NEW up to 128.
Exit status 3 (and a line saying so) where transformers or torch is missing.
"""
import json
import sys

try:
    import torch
    import transformers
except ImportError as e:
    print(f"missing: {e}")
    sys.exit(3)


def main():
    kind, out, text, t = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    windows = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    new = int(sys.argv[6]) if len(sys.argv) > 6 else None
    positions = 64 if new is None else 160
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=positions, n_embd=64, n_layer=2, n_head=4,
                                      layer_norm_epsilon=1e-5, activation_function="gelu_new",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                       rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=positions,
                                       attention_dropout=0.0)
        model = transformers.LlamaForCausalLM(cfg)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    data = open(text, "rb").read()
    losses = []
    for k in range(windows):
        ids = torch.tensor([list(data[k * t : k * t + t + 1])], dtype=torch.long)
        with torch.no_grad():
            logits = model(ids[:, :t]).logits.double()
        losses.append(torch.nn.functional.cross_entropy(logits[0], ids[0, 1 : t + 1]).item())
    out = {"loss": sum(losses) / windows, "transformers": transformers.__version__}
    if new is not None:
        # A random model's ids mean nothing: no id ends the text early.
        model.generation_config.eos_token_id = None
        clean = data.replace(b"\n", b" ")
        out["prompts"], out["generated"] = [], []
        for k, length in enumerate([t, t - 5, t - 11]):
            prompt = torch.tensor([list(clean[k * t : k * t + length])], dtype=torch.long)
            with torch.no_grad():
                ids = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                     attention_mask=torch.ones_like(prompt))
            out["prompts"].append(prompt[0].tolist())
            out["generated"].append(ids[0, length:].tolist())
    print(json.dumps(out))


main()
