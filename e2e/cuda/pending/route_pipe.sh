#!/usr/bin/env bash
# Session 41: branch route's device work for one warm machine, in order of priority, as a background
# job (`setsid bash e2e/cuda/pending/route_pipe.sh &`): logs in /root/pipe (P.log the progress);
# route_watch.sh starts and follows it. The binaries are copied to /root/bin first: a later call's
# carry replaces .device (and with it the unpacked binaries) while this job runs.
set -uo pipefail
cd "$(dirname "$0")/../../.."
D=e2e/cuda/pending
P=/root/pipe; mkdir -p $P /root/bin
exec > $P/P.log 2>&1
export GLMFLASH_KERNEL_CACHE=/tmp/glmflash-kernel-cache
for b in glmflash-node glmflash-node-new; do BIN=.device/$b source e2e/cuda/nvrtc_path.sh; cp .device/$b /root/bin/; done
M=/root/bin/glmflash-node N=/root/bin/glmflash-node-new
T0=$(date +%s)
log() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
summ() { grep -E "^[0-9]+ cases|FAIL" "$1" | tail -${2:-8}; }
sha256sum $M $N | cut -c1-16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export SCRATCH=/root/bf LAYERS=3 RUNS=vram DECODERS=gpu WARMUP=8 DECODE=64
log "P0 the benchmark's model and store, in the background (RUNS=none: made, then refused)"
RUNS=none BIN=$M bash e2e/cuda/bench_flash.sh $P/b0 > $P/b0.out 2>&1 &
store_pid=$!
log "P1 new cuda-check --wide --only router,dsa,decode,graph,matvec"
timeout 300 $N cuda-check --wide --only router,dsa,decode,graph,matvec > $P/p1.log 2>&1; log "rc=$?"; summ $P/p1.log
grep -E "^route|select" $P/p1.log | grep -v " ok" | head -5
for s in 4 2; do
  log "P1.$s new MOE_Q4K_STAGES=$s cuda-check --wide --only moe"
  GLMFLASH_KERNEL_DEFINES=MOE_Q4K_STAGES=$s timeout 120 $N cuda-check --wide --only moe > $P/p1_$s.log 2>&1; log "rc=$?"; summ $P/p1_$s.log
done
wait $store_pid; log "P0 done"; tail -2 $P/b0/flash.log
bin() { case $1 in main) echo $M;; *) echo $N;; esac; }
defs() { case $1 in new:*) echo "${1#new:}";; *) echo "";; esac; }
i=0
for v in main new new:MOE_Q4K_STAGES=4 main new new:MOE_Q4K_STAGES=2 new:MOE_Q4K_STAGES=4; do
  i=$((i+1))
  log "P2.$i bench_flash vram $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" BIN=$(bin $v) timeout 200 bash e2e/cuda/bench_flash.sh $P/b$i > $P/b$i.out 2>&1
  log "rc=$?"
  python3 $D/flash_summary.py $P/b$i/flash.json
done
log "P2b moe-speed"
for v in main new new:MOE_Q4K_STAGES=2 new:MOE_Q4K_STAGES=4; do
  echo "-- $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" timeout 60 $(bin $v) cuda-check --only moe-speed 2>&1 | grep -E "^moe "
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
FLASH="bench --flash --device cuda --scratch /root/bf --keep --flash-moe-layers 3 --flash-runs vram --flash-decoders gpu --prompt-tokens 16"
log "P3 ncu of the step, new"
timeout 300 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  $N $FLASH --warmup-tokens 2 --decode-tokens 6 2> $P/ncu.err | gzip > $P/ncu.csv.gz
log "rc=$?"
python3 e2e/exl3/ncu_summary.py $P/ncu.csv.gz --marker mla_absorb_q --steps 6 | head -30
log "P4 ncu sections of the four big kernels (what bounds them), new"
timeout 300 $NCU --clock-control none -k regex:'^(matvec_t1|matvec_t4|moe_gate_up|moe_down)$' \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --csv --page details --print-units base \
  $N $FLASH --warmup-tokens 1 --decode-tokens 2 2> $P/ncu_sec.err | gzip > $P/ncu_sec.csv.gz
log "rc=$?"
python3 $D/ncu_sections.py $P/ncu_sec.csv.gz | head -150
log "DONE"
