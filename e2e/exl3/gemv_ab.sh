#!/usr/bin/env bash
# The EXL3 GEMV of two builds side by side on one GPU, in one device call: `cuda-check --only
# exl3 --wide` of $NEW (every EXL3 check, then the GEMV's timings at expert and 16k shapes) and
# of $OLD (the timings to compare), and the standalone kernel_check.cu's timings at each
# register budget in $MIN_BLOCKS (EXL3_GEMV_MIN_BLOCKS; nvcc + cuBLAS on the machine).
#   OLD=.device/glmflash-node-old NEW=.device/glmflash-node bash e2e/exl3/gemv_ab.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-${OUT:-/tmp/gemv-ab}}"
NEW="${NEW:-.device/glmflash-node}"
OLD="${OLD:-}"
mkdir -p "$OUT"
source e2e/cuda/nvrtc_path.sh
export GLMFLASH_KERNEL_CACHE="${GLMFLASH_KERNEL_CACHE:-/tmp/glmflash-kernel-cache}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
"$NEW" cuda-check --wide --only "${CHECK_ONLY:-exl3}" > "$OUT/new.txt" 2>&1 || rc=1
grep -E "cases|FAIL" "$OUT/new.txt" | tail -5
if [ -n "$OLD" ]; then "$OLD" cuda-check --wide --only exl3 > "$OUT/old.txt" 2>&1; fi
# Timings side by side: label, old, new.
python3 - "$OUT/old.txt" "$OUT/new.txt" <<'PY' | tee "$OUT/gemv_ab.txt"
import re, sys
def times(p):
    try: text = open(p).read()
    except OSError: return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(exl3 .* n=\d+): ([0-9.]+) us", text, re.M)}
old, new = times(sys.argv[1]), times(sys.argv[2])
for k, v in new.items():
    o = old.get(k)
    print(f"{k:48s} old {o if o else float('nan'):8.1f} us  new {v:8.1f} us  {o / v if o else float('nan'):5.2f}x")
PY
if command -v nvcc >/dev/null; then
  for mb in ${MIN_BLOCKS:-4 2}; do
    nvcc -O3 -arch=sm_90 -std=c++17 -Ikernels/cuda -DEXL3_GEMV_MIN_BLOCKS="$mb" e2e/exl3/kernel_check.cu \
      -lcublas -o "/tmp/kcheck$mb" && "/tmp/kcheck$mb" > "$OUT/kernel_check_$mb.txt" 2>&1
    echo "kernel_check EXL3_GEMV_MIN_BLOCKS=$mb rc=$?"; tail -12 "$OUT/kernel_check_$mb.txt"
  done
fi
exit $rc
