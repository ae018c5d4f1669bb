#!/usr/bin/env bash
# Session 42: branch xperm (route's four commits, then the q4_k MoE rows reading x and act in
# lane-of-32 order) checked, and timed against main and route, on one warm machine, as a background
# job (`watch.sh s42`): logs in /root/s42 (P.log the progress). Binaries, gzipped in .device:
# glmflash-node (main 7a9a426), glmflash-node-new (route d4cbb35), glmflash-node-xperm.
set -uo pipefail
cd "$(dirname "$0")/../../.."
D=e2e/cuda/pending
P=/root/s42; mkdir -p $P /root/bin
exec > $P/P.log 2>&1
export GLMFLASH_KERNEL_CACHE=/tmp/glmflash-kernel-cache
for b in glmflash-node glmflash-node-new glmflash-node-xperm; do BIN=.device/$b source e2e/cuda/nvrtc_path.sh; cp .device/$b /root/bin/; done
M=/root/bin/glmflash-node R=/root/bin/glmflash-node-new X=/root/bin/glmflash-node-xperm
T0=$(date +%s)
log() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
summ() { grep -E "^[0-9]+ cases|FAIL" "$1" | tail -${2:-8}; }
bin() { case $1 in main*) echo $M;; route*) echo $R;; *) echo $X;; esac; }
defs() { case $1 in *:*) echo "${1#*:}";; *) echo "";; esac; }
sha256sum $M $R $X | cut -c1-16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export SCRATCH=/root/bf LAYERS=3 RUNS=vram DECODERS=gpu WARMUP=8 DECODE=64
log "S0 the benchmark's model and store, in the background (RUNS=none: made, then refused)"
RUNS=none BIN=$M bash e2e/cuda/bench_flash.sh $P/b0 > $P/b0.out 2>&1 &
store_pid=$!
log "S1 xperm cuda-check --wide --only moe,router,dsa and (S4) --wide --only decode,graph,matvec, side by side"
timeout 300 $X cuda-check --wide --only moe,router,dsa > $P/s1.log 2>&1 &
s1_pid=$!
GLMFLASH_KERNEL_CACHE=/tmp/kc4 timeout 300 $X cuda-check --wide --only decode,graph,matvec > $P/s4.log 2>&1 &
s4_pid=$!
wait $s1_pid; log "S1 rc=$?"; summ $P/s1.log
grep -E "^route|select" $P/s1.log | grep -v " ok" | head -5
wait $s4_pid; log "S4 rc=$?"; summ $P/s4.log
log "S2 moe-speed"
for v in main route xperm xperm:GATE_UP_ROWS=2; do
  echo "-- $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" timeout 60 $(bin $v) cuda-check --only moe-speed 2>&1 | grep -E "^moe "
done
wait $store_pid; log "S0 done"; tail -2 $P/b0/flash.log
i=0
for v in main xperm main xperm; do
  i=$((i+1))
  log "S3.$i bench_flash vram $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" BIN=$(bin $v) timeout 200 bash e2e/cuda/bench_flash.sh $P/b$i > $P/b$i.out 2>&1
  log "rc=$?"
  python3 $D/flash_summary.py $P/b$i/flash.json
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
FLASH="bench --flash --device cuda --scratch /root/bf --keep --flash-moe-layers 3 --flash-runs vram --flash-decoders gpu --prompt-tokens 16"
for v in xperm route; do
  log "S5 ncu sections of moe_gate_up / moe_down, $v"
  timeout 200 $NCU --clock-control none -k regex:'^(moe_gate_up|moe_down|lane32_x)$' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --csv --page details --print-units base \
    $(bin $v) $FLASH --warmup-tokens 1 --decode-tokens 2 2> $P/ncu_$v.err | gzip > $P/ncu_$v.csv.gz
  log "rc=$?"
  python3 $D/ncu_sections.py $P/ncu_$v.csv.gz > $P/ncu_$v.txt
  grep -iE "^==|duration|throughput|wavefront|registers|achieved occupancy|warp cycles per issued|excessive" $P/ncu_$v.txt | head -50
done
log "S1b xperm MOE_Q4K_STAGES=4 cuda-check --wide --only moe"
GLMFLASH_KERNEL_DEFINES=MOE_Q4K_STAGES=4 timeout 120 $X cuda-check --wide --only moe > $P/s1b.log 2>&1; log "rc=$?"; summ $P/s1b.log
log "S6 ncu of the step, xperm"
timeout 300 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  $X $FLASH --warmup-tokens 2 --decode-tokens 6 2> $P/ncu.err | gzip > $P/ncu.csv.gz
log "rc=$?"
python3 e2e/exl3/ncu_summary.py $P/ncu.csv.gz --marker mla_absorb_q --steps 6 | head -30
log "DONE"
