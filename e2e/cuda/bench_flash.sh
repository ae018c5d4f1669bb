#!/usr/bin/env bash
# The 3090-budget benchmark at GLM-5.3-Flash width on the lent H200 (issue 6, item 5; issue
# 13, item 6), in one device call: `bench --flash` on a random model with its experts in a
# packed store on this machine's disk, once per record format in FORMATS (q4_k, and exl3:3 as
# GLM-5.3-Flash EXL3's experts are; as many MoE layers as the disk holds for the largest
# format, at most 8, the same for every format), with fio's O_DIRECT read rate of the same
# disk when fio exists. Results: $OUT/flash.json (and flash.log) for q4_k, $OUT/flash-exl3-3.json
# (and .log) for exl3:3.
#   e2e/cuda/bench_flash.sh [OUTDIR]     # env: BIN, FORMATS ("q4_k exl3:3"; default q4_k), RUNS, LAYERS, SCRATCH, PREFILL, DECODERS, NO_PIN=1
#   (A/B switches: GLMFLASH_BENCH_NO_FETCH_OVERLAP=1 reads each forward's store misses before computing; GLMFLASH_BENCH_NO_PREFETCH=1 turns the read-ahead off)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN="${BIN:-.device/glmflash-node}"
OUT="${1:-${OUT:-/tmp/device-out}}"
SCRATCH="${SCRATCH:-$PWD/.bench-scratch}"
RUNS="${RUNS:-budget,prefill,exact,vram,fast,zipf}"
mkdir -p "$OUT" "$SCRATCH"
source e2e/cuda/nvrtc_path.sh
export GLMFLASH_KERNEL_CACHE="${GLMFLASH_KERNEL_CACHE:-/tmp/glmflash-kernel-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; free -g | head -2; df -h "$SCRATCH" | tail -1
FORMATS="${FORMATS:-q4_k}"
# Store GB per MoE layer, times 100: 288 records of gate, up and down (4096 x 2048 each),
# 4 KiB-aligned: q4_k 4.08 GB; exl3:RATE a trellis of RATE bits a weight plus f16 suh and svh
# (exl3:3 2.73 GB).
layer_cgb() {
  case "$1" in
    q4_k) echo 408 ;;
    exl3:*) awk -v r="${1#exl3:}" 'BEGIN { b = 3 * (4096 * 2048 * r / 8 + 2 * 6144);
      b = int((b + 4095) / 4096) * 4096; printf "%d\n", 288 * b / 1e7 + 1 }' ;;
    *) echo "FORMATS: q4_k or exl3:RATE, not $1" >&2; return 1 ;;
  esac
}
per=0
for fmt in $FORMATS; do
  c=$(layer_cgb "$fmt") || exit 1
  [ "$c" -gt "$per" ] && per=$c
done
# The store plus about 6 GB of dense checkpoint; keep 6 GB spare (a kept scratch from an
# earlier call counts as free here: one store at a time, another format's is replaced).
kept=$(du -sk "$SCRATCH" | awk '{print $1}')
free_gb=$(( ($(df -k --output=avail "$SCRATCH" | tail -1) + kept) / 1000000 ))
layers=${LAYERS:-$(( (free_gb - 12) * 100 / per ))}
[ "$layers" -gt 8 ] && layers=8
echo "disk: ${free_gb} GB usable -> $layers MoE layers ($FORMATS)"
[ "$layers" -ge 1 ] || { echo "not enough disk for one MoE layer"; exit 1; }
if command -v fio >/dev/null; then
  fio --name=seq --filename="$SCRATCH/fio.tmp" --size=4G --rw=read --bs=14M --direct=1 \
      --ioengine=io_uring --iodepth=8 --runtime=10 --time_based --output-format=terse 2>&1 | awk -F';' '{printf "fio O_DIRECT 14M qd8: %.2f GB/s\n", $7*1024/1e9}'
  rm -f "$SCRATCH/fio.tmp"
fi
rc=0
for fmt in $FORMATS; do
  # q4_k is the bench's default: no flag, so a binary from before the flag runs it too.
  name=flash fmt_flag=()
  [ "$fmt" = q4_k ] || { name="flash-${fmt/:/-}"; fmt_flag=(--flash-expert-format "$fmt"); }
  echo "== $fmt records -> $OUT/$name.json"
  "$BIN" bench --flash --device cuda --scratch "$SCRATCH" --keep --flash-moe-layers "$layers" "${fmt_flag[@]}" \
    --flash-runs "$RUNS" --flash-prefill "${PREFILL:-8192}" --flash-decoders "${DECODERS:-host,gpu}" ${NO_PIN:+--flash-no-pin} --prompt-tokens 256 --warmup-tokens "${WARMUP:-8}" --decode-tokens "${DECODE:-24}" \
    > "$OUT/$name.json" 2> "$OUT/$name.log"
  r=$?
  sed 's/\x1b\[[0-9;]*m//g' "$OUT/$name.log" | grep -v "^\s*$" | tail -40
  # The RAM tier's residents are registered with CUDA; a refusal (logged once) falls back to mlock.
  grep -c "registration refused" "$OUT/$name.log" | xargs echo "CUDA host registration refusals logged:"
  echo "bench $fmt exit $r"
  [ "$r" -eq 0 ] || rc=$r
done
exit $rc
