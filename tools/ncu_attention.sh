#!/usr/bin/env bash
# Nsight Compute reports of fusec's attention kernels beside PyTorch SDPA's
# at the same shapes, on a GPU machine where ncu reads the hardware counters
# (tools/gpu_prepare.sh first, carry out/device). Each case profiles one
# launch of the kernels named, with the full section set, the clocks left as
# the card has them:
#
#   tools/ncu_attention.sh "D:T:which ..."     which: fwd or bwd
#
# e.g. tools/ncu_attention.sh "128:1024:fwd 128:8192:bwd". Reports and their
# text (ncu --page details) go to $OUT (or out/ncu), one pair per case and
# side; the last lines printed are each kernel's duration, registers, shared
# memory, grid and achieved tensor-pipe use.
set -u
BIN=${BIN:-out/device}
DIR=${OUT:-out/ncu}
mkdir -p "$DIR"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FUSEC_ROOT=$(pwd) FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-/tmp/fusec-cache}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
cases=${1:-"128:1024:fwd 128:8192:bwd 64:1024:fwd 64:8192:bwd"}
prof() {  # name regex skip cmd...
  local name=$1 re=$2 skip=$3
  shift 3
  "$NCU" --clock-control none --set full -k "regex:$re" -s "$skip" -c 1 -o "$DIR/$name" -f "$@" >"$DIR/$name.log" 2>&1
  "$NCU" -i "$DIR/$name.ncu-rep" --page details >"$DIR/$name.txt" 2>&1
  echo "== $name"
  grep -E "^  [A-Za-z_]|Duration|Registers Per|Dynamic Shared Memory Per|Grid Size|Block Size|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Executed Ipc Active" "$DIR/$name.txt" | head -24
}
# SDPA's kernel names on this machine, for the regexes above (SDPA_FWD / SDPA_BWD override them).
python3 - <<'PY' 2>&1 | tee "$DIR/sdpa_kernels.txt"
import torch, torch.nn.functional as F
q, k, v = (torch.randn(4, 16, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize()
for e in p.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        print("sdpa kernel:", e.name[:160])
PY
for c in $cases; do
  IFS=: read -r d t which <<<"$c"
  if [ "$which" = fwd ]; then fre='_attention$'; sre=${SDPA_FWD:-'flash_fwd|fprop|fmha_f'}
  else fre='dkdvdq'; sre=${SDPA_BWD:-'dq_dk_dv|bprop|fmha_b'}; fi
  prof "fusec_d${d}_t${t}_$which" "$fre" 3 "$BIN/fusec" bench-attention --head-dims "$d" --seqs "$t"
  prof "sdpa_d${d}_t${t}_$which" "$sre" 3 python3 tools/sdpa_shapes.py --head-dims "$d" --seqs "$t"
done
