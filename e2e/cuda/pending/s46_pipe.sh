#!/usr/bin/env bash
# Session 46: two knobs in one binary (s46.mbox), checked and timed against the landed code:
# FLOAT_XL (bf16/f16 products reading x in lane-of-8 order) and PDL (the step graph's kernels
# started by programmatic dependent launch). `watch.sh s46 SECONDS`; logs in /root/s46 (P.log the
# progress). Binary: .device/glmflash-node-s46 (s46.mbox applied to main, stripped, gzipped).
set -uo pipefail
cd "$(dirname "$0")/../../.."
D=e2e/cuda/pending
P=/root/s46; mkdir -p $P /root/bin
exec > $P/P.log 2>&1
export GLMFLASH_KERNEL_CACHE=/tmp/glmflash-kernel-cache
BIN=.device/glmflash-node-s46 source e2e/cuda/nvrtc_path.sh; cp .device/glmflash-node-s46 /root/bin/
X=/root/bin/glmflash-node-s46
T0=$(date +%s)
log() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
summ() { grep -E "^[0-9]+ cases|FAIL" "$1" | tail -${2:-8}; }
sha256sum $X | cut -c1-16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export SCRATCH=/root/bf LAYERS=3 RUNS=vram DECODERS=gpu WARMUP=8 DECODE=64
log "S0 the benchmark's model and store (background); C1 FLOAT_XL=2 matvec, C2 FLOAT_XL=1 decode,graph, C3 PDL=2 decode,graph"
RUNS=vram DECODE=1 WARMUP=1 BIN=$X bash e2e/cuda/bench_flash.sh $P/b0 > $P/b0.out 2>&1 &
s0=$!
check() { GLMFLASH_KERNEL_DEFINES=$1 GLMFLASH_KERNEL_CACHE=/tmp/kc-$2 timeout 200 $X cuda-check --wide --only $3 > $P/$2.log 2>&1; }
check FLOAT_XL=2 c1 matvec & c1=$!
check FLOAT_XL=1 c2 decode,graph & c2=$!
check PDL=2 c3 decode,graph & c3=$!
wait $c1; log "C1 rc=$?"; summ $P/c1.log
wait $c2; log "C2 rc=$?"; summ $P/c2.log
wait $c3; log "C3 rc=$?"; summ $P/c3.log
log "C4 PDL=2,FLOAT_XL=1 graph (again: a race shows as a mismatch some of the time)"
check PDL=2,FLOAT_XL=1 c4 graph; log "C4 rc=$?"; summ $P/c4.log
wait $s0; log "S0 done"
i=0
for v in "" PDL=1 PDL=2 FLOAT_XL=1 PDL=2,FLOAT_XL=1 "" PDL=1 PDL=2 FLOAT_XL=1 PDL=2,FLOAT_XL=1; do
  i=$((i+1))
  log "B$i bench_flash vram [${v:-landed}]"
  GLMFLASH_KERNEL_DEFINES="$v" BIN=$X timeout 120 bash e2e/cuda/bench_flash.sh $P/b$i > $P/b$i.out 2>&1
  log "rc=$?"
  grep -ho "programmatic edges.*" $P/b$i.out $P/b$i/*.log 2>/dev/null | sort | uniq -c | head -4
  python3 $D/flash_summary.py $P/b$i/flash.json
done
for v in "" FLOAT_XL=1; do
  log "matvec speeds [${v:-landed}]"
  GLMFLASH_KERNEL_DEFINES="$v" timeout 120 $X cuda-check --wide --only matvec 2>&1 | grep -E "^[0-9]+ cases|^matvec bf16 .*n=4 fitted"
done
log "DONE"
