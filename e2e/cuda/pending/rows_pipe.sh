#!/usr/bin/env bash
# Session 40: everything for one warm machine, in order of priority, as a background job
# (`setsid bash e2e/cuda/pending/rows_pipe.sh &`): logs in /root/pipe (P.log the progress). rows_watch.sh follows it.
set -uo pipefail
cd "$(dirname "$0")/../../.."
P=/root/pipe; mkdir -p $P
exec > $P/P.log 2>&1
export GLMFLASH_KERNEL_CACHE=/tmp/glmflash-kernel-cache
for b in glmflash-node glmflash-node-new; do BIN=.device/$b source e2e/cuda/nvrtc_path.sh; done
M=.device/glmflash-node N=.device/glmflash-node-new
T0=$(date +%s)
log() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
sha256sum $M $N | cut -c1-16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
summ() { grep -E "^[0-9]+ cases|FAIL" "$1" | tail -${2:-8}; }
bin() { case $1 in main) echo $M;; *) echo $N;; esac; }
defs() { case $1 in new:*) echo "${1#new:}";; *) echo "";; esac; }
export SCRATCH=/root/bf LAYERS=3 RUNS=vram DECODERS=gpu WARMUP=8 DECODE=64
log "P0 the benchmark's model and store, in the background (--flash-runs none: made, then refused)"
RUNS=none BIN=$M bash e2e/cuda/bench_flash.sh $P/b0 > $P/b0.out 2>&1 &
store_pid=$!
log "P1 main cuda-check --wide --only moe,exl3"
timeout 200 $M cuda-check --wide --only moe,exl3 > $P/p1.log 2>&1; log "rc=$?"; summ $P/p1.log
log "P2 new cuda-check --wide --only matvec,moe,dense,decode,graph,mhc"
timeout 240 $N cuda-check --wide --only matvec,moe,dense,decode,graph,mhc > $P/p2.log 2>&1; log "rc=$?"; summ $P/p2.log
grep "fitted tile" $P/p2.log
log "P3 new T4_ROWS=2 DOWN_ROWS=4 GATE_UP_ROWS=2 T1_STAGES=8 T4_STAGES=4: --wide --only matvec,moe"
GLMFLASH_KERNEL_DEFINES="T4_ROWS=2 DOWN_ROWS=4 GATE_UP_ROWS=2 T1_STAGES=8 T4_STAGES=4" timeout 150 $N cuda-check --wide --only matvec,moe > $P/p3.log 2>&1; log "rc=$?"; summ $P/p3.log
grep "fitted tile" $P/p3.log
log "P4 new T1_STAGES=4 T4_STAGES=2 DOWN_ROWS=1: --only matvec,moe"
GLMFLASH_KERNEL_DEFINES="T1_STAGES=4 T4_STAGES=2 DOWN_ROWS=1" timeout 80 $N cuda-check --only matvec,moe > $P/p4.log 2>&1; log "rc=$?"; summ $P/p4.log
wait $store_pid; log "P0 done"; tail -3 $P/b0/flash.log
i=0
for v in main new:DOWN_ROWS=4,GATE_UP_ROWS=2,T1_STAGES=8,T4_STAGES=4 new main new:DOWN_ROWS=4,GATE_UP_ROWS=2,T1_STAGES=8,T4_STAGES=4,T4_ROWS=2 new:DOWN_ROWS=4,GATE_UP_ROWS=2; do
  i=$((i+1))
  log "P5.$i bench_flash vram $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" BIN=$(bin $v) timeout 400 e2e/cuda/bench_flash.sh $P/b$i > $P/b$i.out 2>&1
  log "rc=$?"
  python3 e2e/cuda/pending/flash_summary.py $P/b$i/flash.json
done
log "P6 moe-speed"
for v in main new:DOWN_ROWS=1 new new:DOWN_ROWS=4 new:DOWN_ROWS=4,GATE_UP_ROWS=2; do
  echo "-- $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" timeout 120 $(bin $v) cuda-check --only moe-speed 2>&1 | grep -E "^moe "
done
log "P7 matvec speeds"
for v in main new:T4_ROWS=2 new:T1_STAGES=16,T4_STAGES=6 new:T4_STAGES=4,T4_ROWS=2; do
  echo "-- $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" timeout 120 $(bin $v) cuda-check --wide --only matvec 2>&1 | grep "fitted tile"
done
log "P8 ncu bench_flash vram, new:${NCU_DEFS:=T1_STAGES=8,T4_STAGES=4,DOWN_ROWS=4,GATE_UP_ROWS=2}"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
GLMFLASH_KERNEL_DEFINES="$NCU_DEFS" timeout 400 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  $N bench --flash --device cuda --scratch /root/bf --keep --flash-moe-layers 3 --flash-runs vram --flash-decoders gpu \
  --prompt-tokens 16 --warmup-tokens 2 --decode-tokens 6 2> $P/ncu.err | gzip > $P/ncu.csv.gz
log "rc=$?"
python3 e2e/exl3/ncu_summary.py $P/ncu.csv.gz --marker mla_absorb_q --steps 6 | head -24
log "DONE"
