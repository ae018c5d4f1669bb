#!/bin/bash
# Both peers against glmflash on the device (issue 16): llama.cpp on one random glm5_next
# checkpoint (e2e/peers/device_run.sh), exllamav3 on one random EXL3 checkpoint
# (e2e/exl3/peer_bench.sh), each at GLM-5.3-Flash width, with the kernel checks of the binary.
# `all` runs every phase in order; on a device whose calls end after 10 minutes run the phases
# as three calls that follow each other on the warm machine (the builds live in /root):
#
#   bash e2e/peers/run.sh all
#   bash e2e/peers/run.sh prepare [WAIT_S]   both peers' builds in the background (llama.cpp:
#                                               e2e/peers/device_run.sh build; exllamav3's JIT
#                                               extension: e2e/exl3/peer_bench.sh build), and while
#                                               they run the kernel checks of the binary
#                                               (cuda-check CHECK groups, compute-sanitizer memcheck
#                                               on SANITIZE groups); then waits up to WAIT_S (560)
#   bash e2e/peers/run.sh exl3                  exllamav3 against glmflash on one EXL3 checkpoint at
#                                               GLM-5.3-Flash width (peer_bench.sh run), then the
#                                               device check (ONLY, default its exl3 step)
#   bash e2e/peers/run.sh llama                 llama.cpp against glmflash (e2e/peers/device_run.sh run)
#
# Carry: .device/glmflash-node (a release build), .whl/exl3 (exllamav3's wheels), .peers (the
# pruned llama.cpp tree). Everything lands in $OUT/<part>/ and, as one archive, $OUT/all.tgz.
set -u
MODE=${1:?all|prepare|exl3|llama}
if [ "$MODE" = all ]; then
  for phase in prepare exl3 llama; do bash "$0" "$phase" || exit $?; done
  exit 0
fi
REPO=$(pwd)
OUT=${OUT:-$REPO/device_out}
export BIN=${BIN:-.device/glmflash-node}
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar -C "$OUT" --exclude='*.part*' --exclude=all.tgz -czf "$OUT/all.tgz" . ; ls -la "$OUT"; }
chmod +x "$BIN" 2>/dev/null

case $MODE in
  prepare)
    WAIT=${2:-560}
    mkdir -p "$OUT/llama" "$OUT/exl3"
    OUT=$OUT/llama setsid bash e2e/peers/device_run.sh build "$WAIT" > /dev/null 2>&1 < /dev/null &
    lpid=$!
    OUT=$OUT/exl3 setsid bash e2e/exl3/peer_bench.sh build "$WAIT" > /dev/null 2>&1 < /dev/null &
    epid=$!
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
      ls "$d"/libnvrtc.so* >/dev/null 2>&1 && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && break
    done
    export GLMFLASH_KERNEL_CACHE=/root/glmflash-kernel-cache
    log "cuda-check --only ${CHECK:-moe,exl3} --wide"
    "$BIN" cuda-check --only "${CHECK:-moe,exl3}" --wide > "$OUT/cuda_check.txt" 2>&1
    log "cuda-check rc=$?: $(grep -cE 'FAIL' "$OUT/cuda_check.txt") failing lines; $(tail -1 "$OUT/cuda_check.txt")"
    grep -E "FAIL|device: same bits" "$OUT/cuda_check.txt" | head -20
    if command -v compute-sanitizer >/dev/null || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
      cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      "$cs" --tool memcheck --error-exitcode 9 "$BIN" cuda-check --only "${SANITIZE:-moe}" > "$OUT/memcheck.txt" 2>&1
      log "memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.txt" | tail -1)"
    fi
    wait $lpid $epid
    log "llama.cpp build: $(grep -E 'built|FAILED|still running' "$OUT/llama/log.txt" | tail -1)"
    log "exllamav3 build: $(grep -E 'JIT build|extension|FAILED|still running' "$OUT/exl3/log.txt" | tail -1)"
    ;;
  exl3)
    OUT=$OUT/exl3 BUDGET_S=${BUDGET_S:-330} bash e2e/exl3/peer_bench.sh run > /dev/null 2>&1
    tail -25 "$OUT/exl3/log.txt"
    export ONLY=${ONLY:-exl3}
    bash e2e/cuda/device_check.sh "$OUT/check" > "$OUT/device_check.txt" 2>&1
    log "device_check ($ONLY) rc=$?"; tail -30 "$OUT/device_check.txt"
    ;;
  llama)
    OUT=$OUT/llama bash e2e/peers/device_run.sh run > /dev/null 2>&1
    tail -40 "$OUT/llama/log.txt"
    ;;
  *) echo "usage: $0 all | prepare [WAIT_S] | exl3 | llama" >&2; exit 2 ;;
esac
pack
