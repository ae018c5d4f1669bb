#!/usr/bin/env bash
# Session 44, after landing route + xperm + dperm: knobs that may take issue 17's four-stream step
# to 0.5 of its roofline, timed against the landed code (no knobs) in one binary, with the checks
# of the paths they change. `watch.sh s44 SECONDS`; logs in /root/s44 (P.log the progress).
#   MOE_XL=0            the q4_k MoE rows read x in order (no lane32_x; xperm's order did not help)
#   MOE_MIN_BLOCKS=1    without xperm's six-blocks register bound
#   T4_R2_BELOW=N       bf16 products at four tokens of fewer than N rows two rows a warp
set -uo pipefail
cd "$(dirname "$0")/../../.."
D=e2e/cuda/pending
P=/root/s44; mkdir -p $P /root/bin
exec > $P/P.log 2>&1
export GLMFLASH_KERNEL_CACHE=/tmp/glmflash-kernel-cache
BIN=.device/glmflash-node-s44 source e2e/cuda/nvrtc_path.sh; cp .device/glmflash-node-s44 /root/bin/
X=/root/bin/glmflash-node-s44
T0=$(date +%s)
log() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
summ() { grep -E "^[0-9]+ cases|FAIL" "$1" | tail -${2:-8}; }
sha256sum $X | cut -c1-16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export SCRATCH=/root/bf LAYERS=3 RUNS=vram DECODERS=gpu WARMUP=8 DECODE=64
KN="MOE_XL=0,MOE_MIN_BLOCKS=1,T4_R2_BELOW=8193"
log "S0 the benchmark's model and store (background); C1 $KN --wide --only moe and C3 --wide --only decode,graph"
RUNS=vram DECODE=1 WARMUP=1 BIN=$X bash e2e/cuda/bench_flash.sh $P/b0 > $P/b0.out 2>&1 &
s0=$!
GLMFLASH_KERNEL_DEFINES=$KN timeout 200 $X cuda-check --wide --only moe > $P/c1.log 2>&1 &
c1=$!
GLMFLASH_KERNEL_DEFINES=$KN GLMFLASH_KERNEL_CACHE=/tmp/kc3 timeout 200 $X cuda-check --wide --only decode,graph > $P/c3.log 2>&1 &
c3=$!
wait $c1; log "C1 rc=$?"; summ $P/c1.log
wait $c3; log "C3 rc=$?"; summ $P/c3.log
wait $s0; log "S0 done"
log "C2 T4_R2_BELOW=8193 --wide --only matvec (checks and speeds)"
GLMFLASH_KERNEL_DEFINES=T4_R2_BELOW=8193 timeout 120 $X cuda-check --wide --only matvec > $P/c2.log 2>&1; log "rc=$?"
summ $P/c2.log 4; grep -E "^matvec bf16 .*fitted" $P/c2.log
i=0
for v in "" MOE_XL=0 MOE_XL=0,MOE_MIN_BLOCKS=1 T4_R2_BELOW=4097 T4_R2_BELOW=8193 "$KN" ""; do
  i=$((i+1))
  log "B$i bench_flash vram [${v:-landed}]"
  GLMFLASH_KERNEL_DEFINES="$v" BIN=$X timeout 120 bash e2e/cuda/bench_flash.sh $P/b$i > $P/b$i.out 2>&1
  log "rc=$?"
  python3 $D/flash_summary.py $P/b$i/flash.json
done
log "moe-speed"
for v in "" MOE_XL=0 MOE_XL=0,MOE_MIN_BLOCKS=1; do
  echo "-- [${v:-landed}]"
  GLMFLASH_KERNEL_DEFINES="$v" timeout 60 $X cuda-check --only moe-speed 2>&1 | grep -E "^moe q4_k"
done
log "DONE"
