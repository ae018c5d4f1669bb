#!/usr/bin/env bash
# Two builds' all-in-VRAM decode side by side on one GPU, with the new build's proof first, in
# one device call (see e2e/exl3/README.md, "Peer decode benchmark", for the checkpoint):
#   1. `cuda-check --wide --only $CHECK_ONLY` of $NEW (every kernel the change touches against the
#      CPU backend),
#   2. `ONLY=$DEVICE_ONLY e2e/cuda/device_check.sh` with $NEW (whole models on the GPU against the
#      CPU, transformers and every tier mode),
#   3. the random GLM-5.3-Flash-width EXL3 checkpoint (peer_bench.sh's), then `bench --model` of
#      $OLD and $NEW in turns, $ROUNDS rounds, each at $BATCHES streams (one JSON line a run).
# While steps 1-2 run, exllamav3's extension may JIT-build in the background (PEER=1: the
# `peer_bench.sh build` of a later call then finds it done); the timings wait for it to end.
#   OLD=.device/glmflash-node-old NEW=.device/glmflash-node [PEER=1] bash e2e/exl3/decode_ab.sh OUTDIR
#   ENVS="base: pool:GLMFLASH_POOL_KEEP_MIB=0" bash e2e/exl3/decode_ab.sh OUTDIR   # one build, env A/B
#   CHECK_ONLY= DEVICE_ONLY= (set and empty) skip steps 1 and 2
#   LANE_FORMATS="q4_k exl3:3" also times the CPU lane's kernels (`bench --lane`) of OLD and NEW
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-${OUT:-/tmp/decode-ab}}"
NEW="${NEW:-.device/glmflash-node}"
OLD="${OLD:-}"
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
source e2e/cuda/nvrtc_path.sh
export GLMFLASH_KERNEL_CACHE="${GLMFLASH_KERNEL_CACHE:-/tmp/glmflash-kernel-cache}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
if [ "${PEER:-0}" = 1 ]; then
  log "exllamav3 extension: JIT build in the background"
  BUDGET_S=5 OUT="$OUT/peer" bash e2e/exl3/peer_bench.sh build 1 > "$OUT/peer_build.txt" 2>&1
fi
if [ -n "${CHECK_ONLY-mhc,exl3}" ]; then
  log "cuda-check --wide --only ${CHECK_ONLY-mhc,exl3}"
  "$NEW" cuda-check --wide --only "${CHECK_ONLY-mhc,exl3}" > "$OUT/cuda_check.txt" 2>&1 || rc=1
  grep -E "FAIL" "$OUT/cuda_check.txt" | head -20; tail -2 "$OUT/cuda_check.txt"
fi
if [ -n "${DEVICE_ONLY-model}" ]; then
  log "device_check ONLY=${DEVICE_ONLY-model}"
  BIN="$NEW" ONLY="${DEVICE_ONLY-model}" timeout -k 5 "${DEVICE_S:-300}" bash e2e/cuda/device_check.sh "$OUT/device" \
    > "$OUT/device_check.txt" 2>&1 || rc=1
  grep -E "PASS|FAIL|rel|==" "$OUT/device_check.txt" | tail -30
fi
pid=$(cat /root/peerw/build.pid 2>/dev/null)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  log "waiting for the exllamav3 JIT build to end before timing"
  BUDGET_S=${PEER_WAIT_S:-300} OUT="$OUT/peer" bash e2e/exl3/peer_bench.sh build "${PEER_WAIT_S:-300}" >> "$OUT/peer_build.txt" 2>&1
  tail -2 "$OUT/peer_build.txt"
fi
if [ -n "${LANE_FORMATS:-}" ]; then
  # The CPU lane's kernels alone (`bench --lane`: a decode step's 8 picks of GLM-5.3-Flash's
  # expert shape, cold and hot), OLD and NEW in turns, every host thread, $ROUNDS rounds.
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for f in $LANE_FORMATS; do
      for which in old new; do
        bin=$NEW; [ "$which" = old ] && bin=$OLD
        [ -n "$bin" ] || continue
        timeout -k 5 120 "$bin" bench --lane --expert-format "$f" --hidden 4096 --expert-width 2048 \
          --top-k 8 --experts 64 > "$OUT/lane_${which}_${f/:/-}_$r.json" 2>/dev/null
        python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], j.get('lane_kernels'), \
' '.join(f\"{c['set']} {c['kernel']} {c['ms_per_step']:.2f} ms {c['weights_gb_per_s']:.1f} GB/s\" for c in j['cases']))" \
          "$OUT/lane_${which}_${f/:/-}_$r.json" "lane $which $f round $r" || echo "lane $which $f round $r: no result"
      done
    done
  done
fi
log "checkpoint"
BUDGET_S=200 OUT="$OUT/ck" bash e2e/exl3/peer_bench.sh checkpoint > "$OUT/checkpoint.txt" 2>&1
tail -2 "$OUT/checkpoint.txt"
ck=/root/peerw/ck_flash
if [ -f "$ck/config.json" ]; then
  # Runs: OLD and NEW, or with ENVS="name:VAR=v,VAR=v name2:VAR=v ..." NEW once per named set
  # of environment variables ("base:" for none).
  runs=(old new)
  [ -n "${ENVS:-}" ] && read -ra runs <<< "$ENVS"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for run in "${runs[@]}"; do
      which=${run%%:*} bin=$NEW env=()
      [ "$which" = old ] && [ -z "${ENVS:-}" ] && bin=$OLD
      [[ "$run" == *:* ]] && IFS=, read -ra env <<< "${run#*:}"
      [ -n "$bin" ] || continue
      env "${env[@]}" timeout -k 5 120 "$bin" bench --model "$ck" --device cuda --prompt-tokens 32 \
        --streams "${BATCHES:-1,4}" --decode-tokens "${STEPS:-128}" \
        > "$OUT/bench_${which}_$r.json" 2> "$OUT/bench_${which}_$r.log"
      log "bench $which (${env[*]}) round $r rc=$?"
    done
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/decode_ab.txt"
import glob, json, os, sys
out = sys.argv[1]
for p in sorted(glob.glob(os.path.join(out, "bench_*_*.json"))):
    try:
        j = json.load(open(p))
    except Exception as e:
        print(os.path.basename(p), "unreadable:", e); continue
    for d in j.get("decode", []):
        print(f"{os.path.basename(p):22s} streams {d['streams']}  {d['tok_s']:8.1f} tok/s  "
              f"{d['ms_per_step']:6.3f} ms/step  queue {d.get('host_queue_ms_per_step', float('nan')):6.3f}  "
              f"wait {d.get('wait_ms_per_step', float('nan')):6.3f}  roofline {d['roofline_ratio']:.3f}")
PY
else
  log "no checkpoint: no timings"; rc=1
fi
log "done rc=$rc"
exit $rc
