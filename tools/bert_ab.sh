#!/usr/bin/env bash
# BERT-large bf16 (B = 32, T = 512, the seed's fine-tune) on two fusec
# builds alternately, then the Hugging Face Trainer's steady step on the
# same GPU, in one call: the ratios mean something only within one call.
#   BASE=out/device/fusec-base NEW=out/device/fusec tools/bert_ab.sh
# ROUNDS (default 2) alternations; PROFILE=1 adds the new build's
# per-kernel table; TRAINER=0 leaves the Trainer out.
set -u
BASE=${BASE:-out/device/fusec-base}
NEW=${NEW:-out/device/fusec}
export FUSEC_ROOT=$(pwd) FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-/tmp/fusec-cache}
ARGS="dsl-examples/bert-classifier.dsl --set d=1024 --set layers=24 --set n_heads=16 --precision bf16 --batch 32 --dim T=512 --steps 20"
LOG=${OUT:-/tmp}/bert_ab.log
: > "$LOG"
bench() { timeout 200 "$1" bench $ARGS "${@:2}" 2>&1 | tee -a "$LOG" | grep '"ms_per_step"' | tail -1; }
for r in $(seq ${ROUNDS:-2}); do
  for b in "$BASE" "$NEW"; do
    [ -x "$b" ] || continue
    echo "== round $r: $b"; bench "$b"
  done
done
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== profile: $NEW"
  bench "$NEW" --profile "${OUT:-/tmp}/bert_profile.jsonl" > /dev/null
  python3 - "${OUT:-/tmp}/bert_profile.jsonl" <<'PY'
import json, sys, collections
by = collections.defaultdict(lambda: [0.0, 0])
for line in open(sys.argv[1]):
    try: k = json.loads(line)
    except ValueError: continue
    name = k["kernel"]
    fam = name.split("_", 1)[1] if name.startswith("k") and "_" in name else name
    by[fam][0] += k.get("ms", 0.0) * 1000; by[fam][1] += 1
for fam, (us, n) in sorted(by.items(), key=lambda x: -x[1][0])[:16]:
    print(f"  {fam:40s} {us / 1000:8.2f} ms  x{n}")
PY
fi
if [ "${TRAINER:-1}" = 1 ] && [ -f out/device/hf_trainer_bert.py ]; then
  echo "== Trainer, eager, steady step"
  timeout 300 python3 tools/trainer_step_times.py --skip 8 out/device/hf_trainer_bert.py --bf16 \
    --optim adamw_torch_fused --batch 32 --samples 2048 2>&1 | tee -a "$LOG" | tail -1
fi
