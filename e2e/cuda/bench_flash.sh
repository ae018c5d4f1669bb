#!/usr/bin/env bash
# The 3090-budget benchmark at GLM-5.3-Flash width on the lent H200 (issue 6, item 5), in one
# device call: `bench --flash` on a random model with q4_k experts in a packed store on this
# machine's disk (as many MoE layers as the disk holds, at most 8), with fio's O_DIRECT read
# rate of the same disk when fio exists. Results: $OUT/flash.json (and flash.log).
#   e2e/cuda/bench_flash.sh [OUTDIR]     # env: BIN, RUNS, LAYERS, SCRATCH, PREFILL, DECODERS, NO_PIN=1
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN="${BIN:-.device/glmflash-node}"
OUT="${1:-${OUT:-/tmp/device-out}}"
SCRATCH="${SCRATCH:-$PWD/.bench-scratch}"
RUNS="${RUNS:-budget,prefill,exact,vram,fast,zipf}"
mkdir -p "$OUT" "$SCRATCH"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
done
export GLMFLASH_KERNEL_CACHE="${GLMFLASH_KERNEL_CACHE:-/tmp/glmflash-kernel-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; free -g | head -2; df -h "$SCRATCH" | tail -1
# 4.08 GB of store per MoE layer plus about 6 GB of dense checkpoint; keep 6 GB spare
# (a kept scratch from an earlier call counts as free here).
kept=$(du -sk "$SCRATCH" | awk '{print $1}')
free_gb=$(( ($(df -k --output=avail "$SCRATCH" | tail -1) + kept) / 1000000 ))
layers=${LAYERS:-$(( (free_gb - 12) * 100 / 408 ))}
[ "$layers" -gt 8 ] && layers=8
echo "disk: ${free_gb} GB usable -> $layers MoE layers"
[ "$layers" -ge 1 ] || { echo "not enough disk for one MoE layer"; exit 1; }
if command -v fio >/dev/null; then
  fio --name=seq --filename="$SCRATCH/fio.tmp" --size=4G --rw=read --bs=14M --direct=1 \
      --ioengine=io_uring --iodepth=8 --runtime=10 --time_based --output-format=terse 2>&1 | awk -F';' '{printf "fio O_DIRECT 14M qd8: %.2f GB/s\n", $7*1024/1e9}'
  rm -f "$SCRATCH/fio.tmp"
fi
"$BIN" bench --flash --device cuda --scratch "$SCRATCH" --keep --flash-moe-layers "$layers" \
  --flash-runs "$RUNS" --flash-prefill "${PREFILL:-8192}" --flash-decoders "${DECODERS:-host,gpu}" ${NO_PIN:+--flash-no-pin} --prompt-tokens 256 --warmup-tokens "${WARMUP:-8}" --decode-tokens "${DECODE:-24}" \
  > "$OUT/flash.json" 2> "$OUT/flash.log"
rc=$?
sed 's/\x1b\[[0-9;]*m//g' "$OUT/flash.log" | grep -v "^\s*$" | tail -40
# The RAM tier's residents are registered with CUDA; a refusal (logged once) falls back to mlock.
grep -c "registration refused" "$OUT/flash.log" | xargs echo "CUDA host registration refusals logged:"
echo "bench exit $rc"
exit $rc
