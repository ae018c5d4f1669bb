#!/usr/bin/env bash
# Session 43: branch dperm (xperm's five commits, then the q4_k dense products reading x in
# lane-of-32 order; session 44: the bf16 products at 2 and 4 tokens in lane-of-8 order under the
# knob FLOAT_XL=1) checked, and timed against main, on one warm machine, as a background job
# (`watch.sh s43`): logs in /root/s43 (P.log the progress). Binaries, gzipped in .device:
# glmflash-node (main), glmflash-node-dperm (the branch). Steps in order of need: checks, issue 17's
# benchmark, the products' speeds, then profiles.
set -uo pipefail
cd "$(dirname "$0")/../../.."
D=e2e/cuda/pending
P=/root/s43; mkdir -p $P /root/bin
exec > $P/P.log 2>&1
export GLMFLASH_KERNEL_CACHE=/tmp/glmflash-kernel-cache
for b in glmflash-node glmflash-node-dperm; do BIN=.device/$b source e2e/cuda/nvrtc_path.sh; cp .device/$b /root/bin/; done
M=/root/bin/glmflash-node X=/root/bin/glmflash-node-dperm
T0=$(date +%s)
log() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
summ() { grep -E "^[0-9]+ cases|FAIL" "$1" | tail -${2:-8}; }
bin() { case $1 in main*) echo $M;; *) echo $X;; esac; }
defs() { case $1 in *:*) echo "${1#*:}";; *) echo "";; esac; }
sha256sum $M $X | cut -c1-16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export SCRATCH=/root/bf LAYERS=3 RUNS=vram DECODERS=gpu WARMUP=8 DECODE=64
log "S0 the benchmark's model and store, in the background (RUNS=none: made, then refused)"
RUNS=none BIN=$M bash e2e/cuda/bench_flash.sh $P/b0 > $P/b0.out 2>&1 &
store_pid=$!
log "S1 dperm cuda-check --wide --only moe,router,dsa and (S4) --wide --only decode,graph, side by side"
timeout 300 $X cuda-check --wide --only moe,router,dsa > $P/s1.log 2>&1 &
s1_pid=$!
GLMFLASH_KERNEL_CACHE=/tmp/kc4 timeout 300 $X cuda-check --wide --only decode,graph > $P/s4.log 2>&1 &
s4_pid=$!
wait $s1_pid; log "S1 rc=$?"; summ $P/s1.log
grep -E "^route|select" $P/s1.log | grep -v " ok" | head -5
wait $s4_pid; log "S4 rc=$?"; summ $P/s4.log
wait $store_pid; log "S0 done"; tail -2 $P/b0/flash.log
i=0
for v in main dperm dperm:FLOAT_XL=1 dperm:FLOAT_XL=2 main dperm dperm:FLOAT_XL=1 dperm:FLOAT_XL=2; do
  i=$((i+1))
  log "S3.$i bench_flash vram $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" BIN=$(bin $v) timeout 200 bash e2e/cuda/bench_flash.sh $P/b$i > $P/b$i.out 2>&1
  log "rc=$?"
  python3 $D/flash_summary.py $P/b$i/flash.json
done
i=0
for v in dperm dperm:FLOAT_XL=2 main; do
  i=$((i+1))
  log "S5.$i $v cuda-check --wide --only matvec (its checks, and the products' speeds alone on the GPU)"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" timeout 240 $(bin $v) cuda-check --wide --only matvec > $P/mv$i.log 2>&1; log "rc=$?"
  summ $P/mv$i.log 4; grep -E "^matvec .*fitted" $P/mv$i.log
done
log "S4b dperm FLOAT_XL=2 cuda-check --wide --only decode,graph (the step with the bf16 products in lane-of-8 order)"
GLMFLASH_KERNEL_DEFINES=FLOAT_XL=2 GLMFLASH_KERNEL_CACHE=/tmp/kc4 timeout 300 $X cuda-check --wide --only decode,graph > $P/s4b.log 2>&1
log "rc=$?"; summ $P/s4b.log
log "S2 moe-speed"
for v in main dperm dperm:GATE_UP_ROWS=2; do
  echo "-- $v"
  GLMFLASH_KERNEL_DEFINES="$(defs $v)" timeout 60 $(bin $v) cuda-check --only moe-speed 2>&1 | grep -E "^moe "
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
FLASH="bench --flash --device cuda --scratch /root/bf --keep --flash-moe-layers 3 --flash-runs vram --flash-decoders gpu --prompt-tokens 16"
log "S6 ncu of the step, dperm"
timeout 300 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  $X $FLASH --warmup-tokens 2 --decode-tokens 6 2> $P/ncu.err | gzip > $P/ncu.csv.gz
log "rc=$?"
python3 e2e/exl3/ncu_summary.py $P/ncu.csv.gz --marker mla_absorb_q --steps 6 | head -30
log "S7 ncu sections of moe_gate_up / moe_down / lane32_x, dperm"
timeout 200 $NCU --clock-control none -k regex:'^(moe_gate_up|moe_down|lane32_x)$' \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --csv --page details --print-units base \
  $X $FLASH --warmup-tokens 1 --decode-tokens 2 2> $P/ncu_s.err | gzip > $P/ncu_s.csv.gz
log "rc=$?"
python3 $D/ncu_sections.py $P/ncu_s.csv.gz > $P/ncu_s.txt
grep -iE "^==|duration|throughput|wavefront|registers|achieved occupancy|warp cycles per issued|excessive" $P/ncu_s.txt | head -50
for k in 0 2; do
  log "S8.$k ncu sections of the bf16 one- and four-token products, dperm FLOAT_XL=$k: is L1 (x's loads) their limit?"
  GLMFLASH_KERNEL_DEFINES=FLOAT_XL=$k timeout 150 $NCU --clock-control none -k regex:'^matvec_(xl_)?t[14]$' --launch-count 24 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --csv --page details --print-units base \
    $X $FLASH --warmup-tokens 1 --decode-tokens 2 2> $P/ncu_t$k.err | gzip > $P/ncu_t$k.csv.gz
  log "rc=$?"
  python3 $D/ncu_sections.py $P/ncu_t$k.csv.gz > $P/ncu_t$k.txt
  grep -iE "^==|duration|throughput|wavefront|achieved occupancy|warp cycles per issued|excessive" $P/ncu_t$k.txt | head -40
done
log "DONE"
