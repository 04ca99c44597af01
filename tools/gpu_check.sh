#!/usr/bin/env bash
# fusec's GPU checks, for a machine with an NVIDIA GPU and no Rust
# toolchain. Build here first (tools/gpu_prepare.sh puts the fusec binary,
# the GPU test binaries and the PyTorch baseline in out/device), carry
# out/device, then run on the GPU machine:
#   tools/gpu_check.sh tests     GPU tests (GEMMs, every kernel, steps, training)
#   tools/gpu_check.sh parity    per-step losses against PyTorch, fp32 and bf16
#   tools/gpu_check.sh bench     GPT-2 small: cold and warm start, fusec bench, PyTorch
#   tools/gpu_check.sh attention the attention sweep, fusec (tensor-core and simple) and PyTorch
#                                (HEAD_DIMS picks the head dims, default 64,80,96,128,160,192,256)
#   tools/gpu_check.sh shapes    grouped queries (4, 8, 16 on 1) and cross-attention (S != T), fusec beside SDPA
#   tools/gpu_check.sh llama     tests/models/llama-hd80.dsl beside torch.compile of its twin
#   tools/gpu_check.sh memory    attention's device memory at B = 1, T = 1024 .. 32768 (one process each)
#   tools/gpu_check.sh feed      fusec train on text (batches staged while the step runs) beside fusec bench
#   tools/gpu_check.sh twins     50 steps of every shipped and twin-test model against its PyTorch twin
#                                (tools/twin_parity.py: fp32 and the model's own precision, f64 as judge;
#                                TWIN_STEPS=2 TWIN_EXTRA=--cpu BIN=target/release tries the cases here;
#                                TWIN_ONLY=REGEX picks models)
#                                (TWIN_TENSORS, default "--tensors 1 --tensors 25": steps judged tensor by tensor)
#   tools/gpu_check.sh zoo       twin parity of drawn models ($BIN/zoo), fp32 and bf16, seeds, step 1 tensor by
#                                tensor, the bf16 drift ratio's distribution (tools/zoo_parity.py; ZOO_MODELS,
#                                ZOO_START, ZOO_SEEDS, ZOO_STEPS, ZOO_JOBS: runs at once, default 6)
#   tools/gpu_check.sh suite     fusec bench beside torch.compile of each shipped transformer's twin
#                                (tools/bench_twins.py, B = 8 and 32; SUITE_ONLY=REGEX picks models)
#   tools/gpu_check.sh dp        data parallel on every GPU of the machine: the dp_gpu test, --gpus N
#                                against one GPU with N x B on text, a two-process launch as a second
#                                machine would join (DP_TRAIN_EXTRA="--zero 0" adds its flags to those two),
#                                their checkpoints compared byte for byte and both resumed from rank 0's,
#                                fusec bench --gpus 1..N (ZeRO stage 1, the default, gradients averaged in
#                                f32 and in bf16, and --zero 0) beside torch_ddp.py
#                                (DP_BATCH per GPU, default 16; DP_TORCH_GPUS picks the DDP runs)
#   tools/gpu_check.sh dpbench   the throughput part of dp alone
#   tools/gpu_check.sh dpwhy     where a data-parallel step's extra time goes: one GPU alone, one
#                                single-GPU bench on every GPU at once (no communication: what
#                                sharing the host costs), --gpus N with its profile (when each
#                                bucket's all-reduce ran and the waits for it) and at bucket sizes
#                                DP_BUCKETS (MiB, default "25 50 100 200"), and an all-reduce of the
#                                tied table's 147 MiB gradient alone (torch.distributed)
#   tools/gpu_check.sh weights   Hugging Face GPT-2 and LLaMA weights through the shipped maps, fusec's
#                                token ids beside the Python tokenizers package, validation on the GPU
#                                beside the CPU reference (tools/import_check.py)
#   tools/gpu_check.sh generate  fusec generate on the GPU against transformers (greedy ids, fp32), multiple-choice
#                                scores against the CPU reference's, samples during training, then decoding
#                                speed beside transformers' generate (tools/bench_generate.py; GEN_ARGS adds
#                                its flags), and gpt2-small's step split and kernels, greedy and sampled, B 1 and 32,
#                                and greedy again with the products on cuBLASLt (--disable-pass skinny-gemm)
#   tools/gpu_check.sh seeds     the seeds' jobs: BERT weights through hf-bert.json against transformers
#                                (tools/hf_bert_check.py), BERT-large beside the Trainer
#                                (hf_trainer_bert.py, bf16 B = 32) and its twin under torch.compile,
#                                the translator with dropout 0 and 0.1 beside its twin under torch.compile
#   tools/gpu_check.sh summary   where fusec stands, in one call: start-up, gpt2-small B = 8 and 32 beside
#                                torch.compile and llm.c, llama-small beside its twin, the attention beside
#                                SDPA; writes the table at the top of docs/benchmarks.md (tools/summary_table.py)
#                                and $OUT/summary.md (SUMMARY_SKIP leaves parts out; LLMC names llm.c's sources)
#   tools/gpu_check.sh tools     which profilers the machine has (nsys, ncu) and their versions
#   tools/gpu_check.sh startup   cold and warm start of fusec train gpt2-small to the end of step 1
#   tools/gpu_check.sh profiles  fusec bench --profile of PROFILE_CASES ("model:B:T ..."): the per-kernel tables
#   tools/gpu_check.sh trace     fusec bench --trace of gpt2-small (B = 8, T = 1024), then fusec train
#                                under nsys and ncu where they are installed: the NVTX ranges they saw
# TORCH_MODES picks torch_reference.py's modes (default: all three).
#   tools/gpu_check.sh all
# Logs go to out/gpu-logs, or, when $OUT is set by the device tool, to
# /tmp/gpu-logs packed into $OUT/gpu-logs.tgz at the end (one file comes
# back however many logs there are). TEST_TIMEOUT bounds each test binary.
set -u
BIN=${BIN:-out/device}
if [ -n "${OUT:-}" ]; then LOGS=/tmp/gpu-logs; else LOGS=out/gpu-logs; fi
mkdir -p "$LOGS"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-logs.tgz" -C "$(dirname "$LOGS")" gpu-logs; }
trap pack EXIT
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FUSEC_ROOT=$(pwd)
export FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-/tmp/fusec-cache}
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
run() { echo "== $*"; }
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in gemm_gpu step_gpu flash_gpu; do
    [ -x "$BIN/$t" ] || { echo "missing $BIN/$t"; continue; }
    run "$t"
    FUSEC_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-400}" "$BIN/$t" --nocapture --test-threads=1 > "$LOGS/$t.log" 2>&1
    echo "exit $?"
    grep -E "^test |test result|skipped|worst|loss|GPU|panicked|error" "$LOGS/$t.log" | head -60
  done
fi
if [ "$what" = parity ] || [ "$what" = all ]; then
  for p in fp32 bf16; do
    run "parity $p"
    timeout 400 python3 tools/torch_parity.py --fusec "$BIN/fusec" --precision "$p" --out "$LOGS/parity-$p.json" 2>&1 | tail -16
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  rm -rf "$FUSEC_CACHE_DIR"
  T=dsl-examples/data/founding-texts.txt
  run "cold start: fusec train gpt2-small"
  /usr/bin/time -f "%e s wall" "$BIN/fusec" train dsl-examples/gpt2-small.dsl --data $T --batch 4 --seq 128 --steps 1 2>&1 | tail -4
  run "warm start"
  /usr/bin/time -f "%e s wall" "$BIN/fusec" train dsl-examples/gpt2-small.dsl --data $T --batch 4 --seq 128 --steps 1 2>&1 | tail -4
  for b in 8 32; do
    run "fusec bench gpt2-small B=$b T=1024"
    timeout 300 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --batch $b --seq 1024 --steps 20 --profile "$LOGS/profile-b$b.jsonl" 2>&1 | tee "$LOGS/bench-b$b.log" | tr "\r" "\n" | grep -v "^  kernels [0-9]" | tail -20
    sort -t: -k3 -g -r "$LOGS/profile-b$b.jsonl" | head -8
  done
  if [ -f "$BIN/torch_reference.py" ]; then
    run "PyTorch baselines B=32"
    timeout 400 python3 "$BIN/torch_reference.py" --models gpt2-small --batch 32 --seq 1024 --no-ceilings ${TORCH_MODES:+--modes $TORCH_MODES} 2>&1 | tail -6 | tee "$LOGS/torch.jsonl"
  fi
fi
if [ "$what" = feed ] || [ "$what" = all ]; then
  T=dsl-examples/data/founding-texts.txt
  for b in 8 32; do
    run "fusec train gpt2-small B=$b T=1024 on text, 30 steps"
    timeout 300 "$BIN/fusec" train dsl-examples/gpt2-small.dsl --data $T --batch $b --seq 1024 --steps 30 --log "$LOGS/feed-b$b.jsonl" 2>&1 | tr "\r" "\n" | grep -E "step +(1|2|10|20|30)/|error" | tail -6
    python3 -c "import json,statistics as s; r=[json.loads(l) for l in open('$LOGS/feed-b$b.jsonl')][5:]; print('train median ms/step', s.median(x['ms'] for x in r))"
    run "fusec bench gpt2-small B=$b T=1024"
    timeout 300 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --batch $b --seq 1024 --steps 20 2>&1 | tail -1
  done
fi
if [ "$what" = memory ] || [ "$what" = all ]; then
  for t in 1024 2048 4096 8192 16384 32768; do
    timeout 200 "$BIN/fusec" bench-attention --head-dims 64 --seqs $t --batch 1 2>&1 | tee -a "$LOGS/attention-memory.jsonl"
  done
fi
if [ "$what" = attention ] || [ "$what" = all ]; then
  DIMS=${HEAD_DIMS:-64,80,96,128,160,192,256}
  run "fusec bench-attention (tensor-core kernels) at head dims $DIMS"
  timeout 400 "$BIN/fusec" bench-attention --head-dims "$DIMS" 2>&1 | tee "$LOGS/attention-flash.jsonl"
  run "fusec bench-attention --simple"
  timeout 400 "$BIN/fusec" bench-attention --simple --seqs 1024,2048 2>&1 | tee "$LOGS/attention-simple.jsonl"
  if [ -f "$BIN/torch_reference.py" ]; then
    run "PyTorch --attn-sweep"
    timeout 400 python3 "$BIN/torch_reference.py" --models "" --no-ceilings --attn-sweep --attn-head-dims "$DIMS" --attn-no-naive 2>&1 | tail -40 | tee "$LOGS/attention-torch.jsonl"
  fi
fi
if [ "$what" = shapes ] || [ "$what" = all ]; then
  # Grouped queries and cross-attention (S != T, no mask), fusec beside SDPA
  # at the same sizes and FLOP count (tools/sdpa_shapes.py).
  for g in 4 8 16; do
    run "grouped queries, $g query heads a key/value head"
    timeout 300 "$BIN/fusec" bench-attention --head-dims 64,80,128 --seqs 1024,4096 --group $g 2>&1 | tee -a "$LOGS/shapes-fusec.jsonl"
    timeout 300 python3 tools/sdpa_shapes.py --head-dims 64,80,128 --seqs 1024,4096 --group $g 2>&1 | tee -a "$LOGS/shapes-sdpa.jsonl"
  done
  for ts in 1024:4096 4096:512; do
    t=${ts%:*} s=${ts#*:}
    run "cross-attention, T = $t queries on S = $s keys, no mask"
    timeout 300 "$BIN/fusec" bench-attention --head-dims 64,80,128 --seqs $t --kv-seq $s --masks none 2>&1 | tee -a "$LOGS/shapes-fusec.jsonl"
    timeout 300 python3 tools/sdpa_shapes.py --head-dims 64,80,128 --seqs $t --kv-seq $s --masks none 2>&1 | tee -a "$LOGS/shapes-sdpa.jsonl"
  done
fi
if [ "$what" = llama ] || [ "$what" = all ]; then
  run "fusec bench tests/models/llama-hd80.dsl B=8 T=1024"
  timeout 300 "$BIN/fusec" bench tests/models/llama-hd80.dsl --batch 8 --seq 1024 --steps 20 2>&1 | tail -1 | tee "$LOGS/llama-fusec.jsonl"
  run "its PyTorch twin under torch.compile"
  timeout 400 python3 tools/bench_llama.py --batch 8 --seq 1024 --modes compiled 2>&1 | tail -1 | tee "$LOGS/llama-torch.jsonl"
fi
if [ "$what" = twins ] || [ "$what" = all ]; then
  # Token models train on a fixed 1 MB text (tools/twin_corpus.py: the
  # same bytes at every commit, so figures compare between runs; 50 steps
  # never see a window twice); the others on random batches, vit-tiny on
  # one fixed batch at a rate where 50 steps do not fit it to zero.
  CORPUS=/tmp/twin-corpus.txt
  python3 tools/twin_corpus.py $CORPUS
  TEXT="--data $CORPUS"
  while read -r model rest; do
    [ -z "$model" ] && continue
    if [ -n "${TWIN_ONLY:-}" ] && ! echo "$model" | grep -Eq "$TWIN_ONLY"; then continue; fi
    log="$LOGS/twin-$(basename "$model" .dsl)"
    run "twin parity $model $rest"
    timeout 500 python3 tools/twin_parity.py "$model" --fusec "$BIN/fusec" ${TWIN_STEPS:+--steps $TWIN_STEPS} ${TWIN_EXTRA:-} \
      ${TWIN_TENSORS---tensors 1 --tensors 25} $rest \
      --out "$log.json" > "$log.log" 2>&1
    echo "exit $?"; grep -E "PASS|FAIL|outside|note|error" "$log.log" | head -12
  done <<CASES
dsl-examples/gpt2-small.dsl --set layers=4 --set d=256 --set n_heads=4 --set vocab=256 --set ctx=256 --batch 8 --seq 256 $TEXT
dsl-examples/llama-small.dsl --set layers=4 --set d=256 --set n_heads=4 --set n_kv_heads=2 --set ffn=688 --set vocab=256 --batch 8 --seq 256 $TEXT
tests/models/twins/gqa-hd80.dsl --batch 8 --seq 256 $TEXT
tests/models/twins/hd40-by-hand.dsl --set vocab=256 --batch 8 --seq 128 $TEXT
tests/models/twins/blocks.dsl --set vocab=256 --batch 8 --seq 64 $TEXT
dsl-examples/bert-encoder.dsl --set layers=2 --set d=128 --set n_heads=2 --set vocab=1000 --set ctx=128 --batch 32 --seq 128
dsl-examples/vit-tiny.dsl --set layers=2 --batch 64 --data random --lr 3e-4
dsl-examples/gpt2-block.dsl --set d=256 --set n_heads=4 --batch 8 --seq 128
dsl-examples/mlp.dsl --batch 256
tests/models/twins/hd96-fp16.dsl --batch 64 --seq 16
tests/models/twins/cross-attention.dsl --batch 16 --seq 32 --dim S=48
tests/models/twins/conv-sgd.dsl --batch 128
tests/models/twins/slicing.dsl --batch 64 --seq 8
tests/models/twins/wide-mlp.dsl --batch 256
tests/models/twins/repeat-shared.dsl --batch 256
CASES
fi
if [ "$what" = zoo ]; then
  # Drawn models (tools/gpu_prepare.sh writes them into $BIN/zoo), each in
  # fp32 and bf16 over several seeds, step 1 tensor by tensor, and the bf16
  # drift ratio's distribution.
  run "twin parity of drawn models"
  timeout ${ZOO_TIMEOUT:-3000} env OMP_NUM_THREADS=2 python3 tools/zoo_parity.py "$BIN/zoo" --fusec "$BIN/fusec" --models ${ZOO_MODELS:-20} \
    --start ${ZOO_START:-0} --jobs ${ZOO_JOBS:-6} --seeds ${ZOO_SEEDS:-3} --steps ${ZOO_STEPS:-40} --out "$LOGS/zoo.json" 2>&1 | tee "$LOGS/zoo.log" | tail -${ZOO_TAIL:-200}
fi
if [ "$what" = dp ]; then
  export NCCL_NVLS_ENABLE=0
  N=$(nvidia-smi -L | wc -l)
  run "dp_gpu test ($N GPUs)"
  FUSEC_REQUIRE_GPUS=1 timeout 300 "$BIN/dp_gpu" --nocapture --test-threads=1 > "$LOGS/dp_gpu.log" 2>&1
  echo "exit $?"; grep -E "^test |test result|GPUs x|panicked|skipped" "$LOGS/dp_gpu.log" | head -20
  T=dsl-examples/data/founding-texts.txt
  SMALL="--set layers=4 --set d=256 --set n_heads=4 --set vocab=256 --set ctx=256 --seq 256 --data $T --steps 20"
  # DP_TRAIN_EXTRA (e.g. "--zero 0") goes to the two-GPU and two-process runs.
  EXTRA=${DP_TRAIN_EXTRA:-}
  for prec in fp32 bf16; do
    run "fusec train --gpus 2 --batch 4 against one GPU with --batch 8 (text, $prec, 20 steps)"
    timeout 120 "$BIN/fusec" train dsl-examples/gpt2-small.dsl $SMALL --precision $prec --batch 8 --log "$LOGS/dp-one-$prec.jsonl" > "$LOGS/dp-one-$prec.log" 2>&1; echo "exit $?"
    timeout 120 "$BIN/fusec" train dsl-examples/gpt2-small.dsl $SMALL --precision $prec --batch 4 --gpus 2 $EXTRA --log "$LOGS/dp-two-$prec.jsonl" --save "$LOGS/dp-two-$prec.safetensors" > "$LOGS/dp-two-$prec.log" 2>&1; echo "exit $?"
    grep -E "error" "$LOGS/dp-two-$prec.log" | head -5
    run "the same as two processes, started as a launcher would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
    for r in 1 0; do
      WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 timeout 120 "$BIN/fusec" train dsl-examples/gpt2-small.dsl $SMALL --precision $prec --batch 4 $EXTRA --log "$LOGS/dp-proc-$prec.jsonl" --save "$LOGS/dp-proc-$prec.safetensors" > "$LOGS/dp-proc$r-$prec.log" 2>&1 &
    done
    wait; grep -E "error" "$LOGS/dp-proc0-$prec.log" "$LOGS/dp-proc1-$prec.log" | head -3
    run "two processes resuming from their own checkpoint for 3 steps, against --gpus 2 resuming from it"
    for r in 1 0; do
      WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29518 timeout 120 "$BIN/fusec" train dsl-examples/gpt2-small.dsl ${SMALL/--steps 20/--steps 3} --precision $prec --batch 4 $EXTRA --resume "$LOGS/dp-proc-$prec.safetensors" --log "$LOGS/dp-proc-res-$prec.jsonl" > "$LOGS/dp-proc-res$r-$prec.log" 2>&1 &
    done
    wait
    timeout 120 "$BIN/fusec" train dsl-examples/gpt2-small.dsl ${SMALL/--steps 20/--steps 3} --precision $prec --batch 4 --gpus 2 $EXTRA --resume "$LOGS/dp-proc-$prec.safetensors" --log "$LOGS/dp-two-res-$prec.jsonl" > "$LOGS/dp-two-res-$prec.log" 2>&1
    grep -E "error" "$LOGS/dp-proc-res0-$prec.log" "$LOGS/dp-proc-res1-$prec.log" "$LOGS/dp-two-res-$prec.log" | head -3
    python3 - "$LOGS/dp-proc-res-$prec.jsonl" "$LOGS/dp-two-res-$prec.jsonl" <<'PY'
import json, sys
rows = [[json.loads(l) for l in open(p)] if __import__("os").path.exists(p) else [] for p in sys.argv[1:]]
steps = [[r["step"] for r in x] for x in rows]
same = bool(rows[0]) and [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
print(f"resumed: two processes logged steps {steps[0]}, --gpus 2 {steps[1]}; the same losses bit for bit: {'PASS' if same else 'FAIL'}")
PY
    python3 - "$LOGS" "$prec" <<'PY'
import json, sys
d, prec = sys.argv[1], sys.argv[2]
def rows(n):
    try:
        return [json.loads(l) for l in open(f"{d}/{n}-{prec}.jsonl")]
    except OSError:
        return []
one, two, proc = rows("dp-one"), rows("dp-two"), rows("dp-proc")
tol = 1e-5 if prec == "fp32" else 1e-2
for name, other in (("--gpus 2", two), ("two processes", proc)):
    if len(other) != len(one) or not one:
        print(f"{name}: {len(other)} steps logged against {len(one)}: FAIL"); continue
    dls = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(other, one)]
    dns = [abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in zip(other, one)]
    rel = [max(x, y) for x, y in zip(dls, dns)]
    dl, dn = max(dls), max(dns)
    past = next((i + 1 for i, r in enumerate(rel) if r > tol), None)
    where = "" if past is None else f"; first past it at step {past} (largest gradient norm {max(b['grad_norm'] for b in one):.3g}), per step: " + " ".join(f"{r:.1e}" for r in rel)
    print(f"{name} x B=4 against 1 GPU x B=8, {prec}, 20 steps on text: worst relative difference loss {dl:.2e}, grad norm {dn:.2e} (allowed {tol:.0e}): {'PASS' if max(dl, dn) <= tol else 'FAIL'}{where}")
if two and proc:
    same = all(a["loss"] == b["loss"] for a, b in zip(two, proc))
    print(f"two processes and --gpus 2 give the same losses bit for bit: {same}")
def tensors(path):
    # safetensors: an 8-byte header length, a JSON header, the raw data.
    try:
        raw = open(path, "rb").read()
    except OSError:
        return None
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    return {k: raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in head.items() if k != "__metadata__"}
a, b = tensors(f"{d}/dp-two-{prec}.safetensors"), tensors(f"{d}/dp-proc-{prec}.safetensors")
if a is None or b is None:
    print(f"checkpoints: --gpus 2 {'written' if a else 'missing'}, two processes {'written' if b else 'missing'}: FAIL")
else:
    differ = sorted(k for k in a if a[k] != b.get(k))
    print(f"checkpoints of --gpus 2 and of two processes (rank 0 gathering the other's state): {len(a)} and {len(b)} tensors, {'the same bytes: PASS' if not differ and a.keys() == b.keys() else f'{len(differ)} differ (e.g. {differ[:3]}): FAIL'}")
PY
    # Compared: too large to come back with the logs.
    rm -f "$LOGS"/dp-*-"$prec".safetensors
  done
fi
if [ "$what" = dp ] || [ "$what" = dpbench ]; then
  export NCCL_NVLS_ENABLE=0
  N=$(nvidia-smi -L | wc -l)
  B=${DP_BATCH:-16}
  for g in $(seq 1 $N); do
    case $g in 1|2|4|8) ;; *) continue ;; esac
    run "fusec bench gpt2-small --gpus $g --batch $B --seq 1024 (with several, ZeRO stage 1: the default)"
    if [ $g = 1 ]; then
      timeout 200 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --batch $B --seq 1024 --steps 30 2>&1 | tail -1 | tee -a "$LOGS/dp-bench.jsonl"
    else
      timeout 200 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --gpus $g --batch $B --seq 1024 --steps 30 2>&1 | tail -1 | tee -a "$LOGS/dp-bench.jsonl"
      run "fusec bench gpt2-small --gpus $g --reduce-dtype bf16 (gradients averaged in bf16)"
      timeout 200 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --gpus $g --reduce-dtype bf16 --batch $B --seq 1024 --steps 30 2>&1 | tail -1 | tee -a "$LOGS/dp-bench.jsonl"
      run "fusec bench gpt2-small --gpus $g --zero 0 (without ZeRO stage 1, every GPU all of the state, as DDP)"
      timeout 200 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --gpus $g --zero 0 --batch $B --seq 1024 --steps 30 2>&1 | tail -1 | tee -a "$LOGS/dp-bench.jsonl"
    fi
  done
  if [ -f "$BIN/torch_ddp.py" ]; then
    TORCHRUN=$(command -v torchrun || echo /opt/torch/.venv/bin/torchrun)
    for g in ${DP_TORCH_GPUS:-$(seq 1 $N)}; do
      case $g in 1|2|4|8) ;; *) continue ;; esac
      run "torch_ddp.py (DDP + torch.compile) on $g GPUs, batch $B per GPU"
      (cd "$BIN" && timeout 300 "$TORCHRUN" --standalone --nproc_per_node $g torch_ddp.py --batch $B --seq 1024 2>&1 | grep "^{" | tail -1 | tee -a "$LOGS/dp-torch.jsonl")
    done
  fi
fi
if [ "$what" = dpwhy ]; then
  export NCCL_NVLS_ENABLE=0
  N=$(nvidia-smi -L | wc -l)
  B=${DP_BATCH:-16}
  ARGS="dsl-examples/gpt2-small.dsl --batch $B --seq 1024 --steps 30"
  run "one GPU alone"
  timeout 200 "$BIN/fusec" bench $ARGS 2>&1 | tail -1
  run "a single-GPU bench on each of the $N GPUs at once"
  for g in $(seq 0 $((N - 1))); do
    CUDA_VISIBLE_DEVICES=$g timeout 200 "$BIN/fusec" bench $ARGS > "$LOGS/dpwhy-$g.log" 2>&1 &
  done
  wait
  for g in $(seq 0 $((N - 1))); do tail -1 "$LOGS/dpwhy-$g.log"; done
  run "--gpus $N, with its profile"
  timeout 200 "$BIN/fusec" bench $ARGS --gpus $N --profile "$LOGS/dpwhy-profile.jsonl" 2>&1 | grep -v "kernels [0-9]" | tail -22
  for mib in ${DP_BUCKETS:-25 50 100 200}; do
    run "--gpus $N --bucket-mib $mib"
    timeout 200 "$BIN/fusec" bench $ARGS --gpus $N --bucket-mib $mib 2>&1 | tail -1
  done
  run "all-reduce (mean) of 147 MiB and of 27 MiB of f32 alone, $N ranks (torch.distributed, NCCL)"
  TORCHRUN=$(command -v torchrun || echo /opt/torch/.venv/bin/torchrun)
  cat > /tmp/allreduce.py <<'PY'
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl")
r = dist.get_rank(); torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", r)))
for mib in (147.24, 27.04):
    x = torch.ones(int(mib * 2**20 / 4), device="cuda")
    for _ in range(5): dist.all_reduce(x)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): dist.all_reduce(x)
    torch.cuda.synchronize(); ms = (time.perf_counter() - t) / 20 * 1e3
    n = dist.get_world_size()
    if r == 0: print(f"all_reduce {mib} MiB f32 on {n} ranks: {ms:.3f} ms, bus bandwidth {2 * (n - 1) / n * mib * 2**20 / ms / 1e6:.0f} GB/s")
dist.destroy_process_group()
PY
  timeout 200 "$TORCHRUN" --standalone --nproc_per_node $N /tmp/allreduce.py 2>&1 | grep all_reduce
fi
if [ "$what" = generate ] || [ "$what" = all ]; then
  export FUSEC_BIN=$(cd "$BIN" && pwd)/fusec
  for t in eval_cli generate_cli; do
    [ -x "$BIN/$t" ] || { echo "missing $BIN/$t"; continue; }
    run "$t"
    FUSEC_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-400}" "$BIN/$t" --nocapture --test-threads=1 > "$LOGS/$t.log" 2>&1
    echo "exit $?"
    grep -E "^test |test result|skip|greedy|panicked|error" "$LOGS/$t.log" | head -40
  done
  run "samples during training"
  timeout 200 "$BIN/fusec" train dsl-examples/gpt2-small.dsl --set layers=2 --data dsl-examples/data/founding-texts.txt \
    --batch 4 --seq 64 --steps 30 --sample-every 15 --sample-prompt "We hold " 2>&1 | grep -E "sample|error" | head
  run "decoding speed beside transformers (tools/bench_generate.py)"
  timeout 500 python3 tools/bench_generate.py --fusec "$BIN/fusec" --out "$LOGS/generate.jsonl" ${GEN_ARGS:-} 2>&1 \
    | tee "$LOGS/bench-generate.log" | grep -v "^\s*$" | grep -v "^W1\|__cudagraphs\|Writing model" | tail -8
  # Where a step's time goes (the bench's gpt2-small weights): greedy and
  # sampled, batch 1 and 32, and one greedy step's kernels (--profile).
  W=/tmp/fusec-bench-generate/gpt2-small/model.safetensors
  for B in 1 32; do
    for T in 0 0.8; do
      run "gpt2-small generate, batch $B, temperature $T"
      timeout 60 "$BIN/fusec" generate dsl-examples/gpt2-small.dsl --weights $W --name-map dsl-examples/maps/hf-gpt2.json \
        --prompt-ids 464,2068,7586,21831,18045,625,262,16931 --num-samples $B --max-new-tokens 256 --json \
        --temperature $T --top-k 50 --profile "$LOGS/generate-b$B-t$T.jsonl" 2>&1 >/dev/null \
        | grep -E "^a step|tokens/s|step launch by launch|^  [a-z_]+ +[0-9]+ " | head -14
    done
    # The same binary with the products on cuBLASLt: what the skinny GEMMs
    # (kernels/gemm/skinny.cuh) gain, in this call.
    run "gpt2-small generate, batch $B, greedy, products on cuBLASLt (--disable-pass skinny-gemm)"
    timeout 60 "$BIN/fusec" generate dsl-examples/gpt2-small.dsl --weights $W --name-map dsl-examples/maps/hf-gpt2.json \
      --prompt-ids 464,2068,7586,21831,18045,625,262,16931 --num-samples $B --max-new-tokens 256 --json \
      --disable-pass skinny-gemm --profile "$LOGS/generate-b$B-cublaslt.jsonl" 2>&1 >/dev/null \
      | grep -E "^a step|tokens/s|step launch by launch|^  [a-z_]+ +[0-9]+ " | head -14
  done
fi
if [ "$what" = weights ] || [ "$what" = all ]; then
  run "pretrained weights, tokenizer and validation (tools/import_check.py)"
  timeout 500 python3 tools/import_check.py --fusec "$BIN/fusec" --work /tmp/import-check 2>&1 | tee "$LOGS/import-check.log" | tail -30
fi
if [ "$what" = seeds ] || [ "$what" = all ]; then
  run "BERT weights against transformers (tools/hf_bert_check.py)"
  timeout 400 python3 tools/hf_bert_check.py --fusec "$BIN/fusec" --work /tmp/bert-check 2>&1 | grep -v "Writing model" | tee "$LOGS/bert-check.log" | tail -8
  L="--set d=1024 --set layers=24 --set n_heads=16"
  run "BERT-large bf16 B=32 T=512: fusec, the Trainer, the twin under torch.compile"
  timeout 200 "$BIN/fusec" bench dsl-examples/bert-classifier.dsl $L --precision bf16 --batch 32 --dim T=512 --steps 20 2>&1 | tail -1 | tee "$LOGS/bert-large.jsonl"
  if [ -f "$BIN/hf_trainer_bert.py" ]; then
    (cd "$BIN" && timeout 200 python3 hf_trainer_bert.py --bf16 --optim adamw_torch_fused --batch 32 --samples 2048 2>&1 | tail -1) | tee -a "$LOGS/bert-large.jsonl"
  fi
  timeout 400 python3 tools/bench_twins.py --fusec "$BIN/fusec" dsl-examples/bert-classifier.dsl --batches 32 --seq 512 $L --precision bf16 --steps 20 2>&1 | tail -3
  run "the translator B=32 S=T=128: dropout 0 and 0.1, and beside its twin under torch.compile"
  for p in 0 0.1; do
    timeout 120 "$BIN/fusec" bench dsl-examples/translator.dsl --set p=$p --batch 32 --dim S=128 --dim T=128 --steps 30 2>&1 | tail -1
  done
  timeout 300 python3 tools/bench_twins.py --fusec "$BIN/fusec" dsl-examples/translator.dsl --batches 32 --seq 128 --dim S=128 --set p=0.1 --steps 20 2>&1 | tail -3
fi
if [ "$what" = tools ]; then
  {
    for t in nsys ncu; do
      p=$(command -v $t || ls /usr/local/cuda/bin/$t /opt/nvidia/*/bin/$t /opt/nvidia/*/*/bin/$t /usr/local/cuda/*/bin/$t 2>/dev/null | head -1)
      echo "$t: ${p:-not found}"; [ -n "$p" ] && "$p" --version 2>&1 | head -2
    done
    ls /usr/local/cuda/lib64 | grep -i -E "nvtx|nvToolsExt" | head
    python3 -c "import transformers, tokenizers, torch; print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'torch', torch.__version__)"
  } 2>&1 | tee "$LOGS/tools.txt"
fi
if [ "$what" = summary ]; then
  # Where fusec stands, in one call: start-up, gpt2-small at B = 8 and 32
  # beside torch.compile and llm.c (cuDNN), the attention beside SDPA,
  # and llama-small beside its twin under torch.compile; then the table at
  # the top of docs/benchmarks.md (tools/summary_table.py; the copy here,
  # and $OUT/summary.md for the machine the call came from). llm.c runs
  # where $LLMC (default .bench/llmc) holds its sources as
  # ../shared/bench/llmc.sh lays them out. SUMMARY_SKIP (space separated:
  # startup gpt2 budget xl torch llmc llama attention f32attention) leaves
  # parts out.
  S=$LOGS/summary; rm -rf "$S"; mkdir -p "$S"
  cp "$LOGS/gpu.txt" "$S/gpu.txt"
  skip() { save; case " ${SUMMARY_SKIP:-} " in *" $1 "*) return 0;; *) return 1;; esac; }
  # What is measured so far goes back after each part, in case the call
  # runs out of time (tools/summary_table.py reads the folder anywhere).
  save() { if [ -n "${OUT:-}" ]; then rm -rf "$OUT/summary"; cp -r "$S" "$OUT/summary"; fi; }
  T=dsl-examples/data/founding-texts.txt
  if ! skip startup; then
    rm -rf "$FUSEC_CACHE_DIR"
    for start in cold warm cold warm cold warm cold warm cold warm; do
      [ "$start" = cold ] && rm -rf "$FUSEC_CACHE_DIR"
      t0=$EPOCHREALTIME
      if "$BIN/fusec" train dsl-examples/gpt2-small.dsl --data $T --batch 4 --seq 128 --steps 1 > "$S/startup-last.log" 2>&1; then
        awk -v a="$t0" -v b="$EPOCHREALTIME" -v k="$start" 'BEGIN { printf "%s %.3f\n", k, b - a }' | tee -a "$S/startup.txt"
      else
        echo "$start start failed:"; tail -3 "$S/startup-last.log"
      fi
    done
  fi
  if ! skip gpt2; then
    for b in 8 32; do
      run "fusec bench gpt2-small B=$b T=1024"
      timeout 300 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --batch $b --seq 1024 --steps 20 2>/dev/null | tail -1 | tee "$S/fusec-gpt2-b$b.json"
    done
  fi
  if ! skip budget; then
    # At llm.c's memory: its B = 8 peak is about 5.0 GiB, fusec's peak is
    # the arena plus about 0.6 GiB (the context, modules and cuBLASLt's
    # workspace), so an arena of 4.4 GiB (GELU outputs recomputed).
    run "fusec bench gpt2-small B=8 T=1024 --memory-budget 4.4GiB"
    timeout 300 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --batch 8 --seq 1024 --steps 20 --memory-budget 4.4GiB 2>/dev/null | tail -1 | tee "$S/fusec-gpt2-b8-budget.json"
  fi
  if ! skip xl; then
    run "fusec bench gpt2-xl B=8 T=1024"
    timeout 400 "$BIN/fusec" bench dsl-examples/gpt2-xl.dsl --batch 8 --seq 1024 --steps 10 2>/dev/null | tail -1 | tee "$S/fusec-gpt2xl-b8.json"
  fi
  if ! skip f32attention; then
    run "attention: fusec and SDPA, causal, f32"
    timeout 200 "$BIN/fusec" bench-attention --precision f32 --head-dims 64,80,128 --seqs 1024,4096 2>/dev/null | tee "$S/attention-f32-fusec.jsonl"
    [ -f "$BIN/torch_reference.py" ] && timeout 300 python3 "$BIN/torch_reference.py" --models "" --no-ceilings --attn-sweep --dtype float32 --attn-head-dims 64,80,128 --attn-seqs 1024,4096 --attn-no-naive 2>/dev/null | grep '^{' | tee "$S/attention-f32-torch.jsonl"
  fi
  if ! skip attention; then
    run "attention: fusec and SDPA, causal, bf16"
    timeout 200 "$BIN/fusec" bench-attention --head-dims 64,128 --seqs 1024,4096 2>/dev/null | tee "$S/attention-fusec.jsonl"
    [ -f "$BIN/torch_reference.py" ] && timeout 200 python3 "$BIN/torch_reference.py" --models "" --no-ceilings --attn-sweep --attn-head-dims 64,128 --attn-seqs 1024,4096 --attn-no-naive 2>/dev/null | grep '^{' | tee "$S/attention-torch.jsonl"
  fi
  if ! skip torch && [ -f "$BIN/torch_reference.py" ]; then
    for b in 8 32; do
      run "torch.compile gpt2-small B=$b"
      timeout 300 python3 "$BIN/torch_reference.py" --models gpt2-small --modes compiled --batch $b --seq 1024 --no-ceilings 2>/dev/null | grep '^{' | tee -a "$S/torch-gpt2.jsonl"
    done
  fi
  LLMC=${LLMC:-.bench/llmc}
  if ! skip llmc && [ -d "$LLMC" ] && [ -f ../shared/bench/llmc.sh -o -f .bench/llmc.sh ]; then
    sh_dir=$( [ -f .bench/llmc.sh ] && echo .bench || echo ../shared/bench )
    shard=$(pwd)/out/llmc-shard.bin
    python3 "$sh_dir/llmc_shard.py" "$shard" 4000000
    for b in 8 32; do
      run "llm.c B=$b"
      timeout 400 bash "$sh_dir/llmc.sh" "$(cd "$LLMC" && pwd)" "$shard" $b 1024 30 2>&1 | tee "$S/llmc-b$b.txt"
    done
  fi
  if ! skip llama; then
    run "llama-small beside its twin under torch.compile"
    timeout 400 python3 tools/bench_twins.py --fusec "$BIN/fusec" --only '^llama-small' --batches 8 --out "$S/llama.jsonl" 2>&1 | tail -3
  fi
  save
  commit=${SUMMARY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  python3 tools/summary_table.py "$S" --commit "$commit" --date "$(date -u +%Y-%m-%d)" --insert docs/benchmarks.md | tee "$S/table.md"
  [ -n "${OUT:-}" ] && cp "$S/table.md" "$OUT/summary.md"
fi
if [ "$what" = startup ]; then
  T=dsl-examples/data/founding-texts.txt
  rm -rf "$FUSEC_CACHE_DIR"
  for start in cold warm warm; do
    run "$start start: fusec train gpt2-small to the end of step 1"
    FUSEC_STARTUP_TIMES=1 python3 tools/startup_timeline.py --grep "start-up|opened|ready|step +1/|weights|exited|error" -- "$BIN/fusec" train dsl-examples/gpt2-small.dsl --data $T --batch 4 --seq 128 --steps 1 2>&1 | tee -a "$LOGS/startup.txt"
  done
fi
if [ "$what" = profiles ]; then
  # PROFILE_CASES: "model:B:T" separated by spaces
  for c in ${PROFILE_CASES:-dsl-examples/gpt2-small.dsl:32:1024}; do
    IFS=: read -r m b t <<< "$c"
    n=$(basename "$m" .dsl)-b$b
    run "fusec bench --profile $m B=$b T=$t"
    timeout 300 "$BIN/fusec" bench "$m" --batch "$b" --seq "$t" --steps 20 --profile "$LOGS/profile-$n.jsonl" 2>&1 | tr "\r" "\n" | grep -v "^  kernels [0-9]" | tee "$LOGS/profile-$n.txt" | tail -40
  done
fi
if [ "$what" = trace ] || [ "$what" = all ]; then
  run "fusec bench --trace gpt2-small B=8 T=1024"
  timeout 300 "$BIN/fusec" bench dsl-examples/gpt2-small.dsl --batch 8 --seq 1024 --steps 20 --trace "$LOGS/trace-gpt2-small.json" --profile "$LOGS/profile-trace.jsonl" 2>&1 | tr "\r" "\n" | grep -v "^  kernels [0-9]" | tee "$LOGS/trace.txt" | tail -8
  ls -la "$LOGS"/trace-gpt2-small.* | tee -a "$LOGS/trace.txt"
  T=dsl-examples/data/founding-texts.txt
  SMALL="--set layers=2 --set d=256 --set n_heads=4 --set vocab=256 --set ctx=256 --batch 4 --seq 256 --data $T"
  NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$NSYS" ]; then
    run "fusec train under nsys: the NVTX ranges"
    timeout 300 "$NSYS" profile -t cuda,nvtx -o /tmp/fusec-nvtx --force-overwrite true "$BIN/fusec" train dsl-examples/gpt2-small.dsl $SMALL --steps 3 > "$LOGS/nsys.log" 2>&1; echo "exit $?"
    grep -E "NVTX|error" "$LOGS/nsys.log" | head -5
    timeout 200 "$NSYS" stats --report nvtx_sum --format csv /tmp/fusec-nvtx.nsys-rep 2>&1 | tee "$LOGS/nsys-nvtx.csv" | head -24
  else
    echo "nsys: not installed here"
  fi
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    run "fusec train under ncu, kernels renamed by their NVTX range"
    timeout 300 "$NCU" --nvtx --print-nvtx-rename kernel --launch-skip 40 --launch-count 6 --section LaunchStats "$BIN/fusec" train dsl-examples/gpt2-small.dsl $SMALL --steps 2 > "$LOGS/ncu.log" 2>&1; echo "exit $?"
    grep -E "dsl:|==PROF==|==ERROR==|error" "$LOGS/ncu.log" | head -20
  else
    echo "ncu: not installed here"
  fi
fi
if [ "$what" = suite ] || [ "$what" = all ]; then
  run "fusec bench beside torch.compile of each twin"
  timeout 1500 python3 tools/bench_twins.py --fusec "$BIN/fusec" ${SUITE_ONLY:+--only $SUITE_ONLY} ${SUITE_MODES:+--modes $SUITE_MODES} --out "$LOGS/suite.jsonl" 2>&1 | tee "$LOGS/suite.log" | tail -16
fi
