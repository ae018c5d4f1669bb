#!/usr/bin/env bash
# The expert-tier benchmark (issue 3, item 10): decode through the device / RAM / store tiers
# on a wide random model, uniform vs Zipf-like routing, LFU vs LRU, against the disk's own
# O_DIRECT bandwidth: the bench's own reader at depth (its roofline), and fio at depth 1 and 8
# in the same run for reference. Prints JSON, then a Markdown table for
# BENCHMARKS.md. Scratch files (model, stores, fio file) go under $SCRATCH and are removed.
#
#   e2e/bench_tiers.sh                      # defaults below
#   PROFILE=test DECODE=32 e2e/bench_tiers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

SCRATCH=${SCRATCH:-/tmp}
PROFILE=${PROFILE:-release}
HIDDEN=${HIDDEN:-1024}
EXPERTS=${EXPERTS:-64}
WIDTH=${WIDTH:-256}
LAYERS=${LAYERS:-4}
TOPK=${TOPK:-8}
PROMPT=${PROMPT:-16}
WARMUP=${WARMUP:-16}
DECODE=${DECODE:-48}
VRAM=${VRAM:-8}
RAM=${RAM:-16}
ZIPF=${ZIPF:-0.1}
FIO_SECONDS=${FIO_SECONDS:-8}

if ! command -v fio >/dev/null; then
    echo "fio is missing; installing it (Debian package fio)" >&2
    apt-get install -y fio >/dev/null || { echo "install fio (apt-get install fio)" >&2; exit 1; }
fi

cargo build --profile "$PROFILE" -p glmflash-node --bin glmflash-node >&2
T=${CARGO_TARGET_DIR:-target}
case "$PROFILE" in dev | test) BIN=$T/debug/glmflash-node ;; *) BIN=$T/$PROFILE/glmflash-node ;; esac

# One record: gate, up, down in bf16, padded to 4 KiB.
RECORD=$(((3 * HIDDEN * WIDTH * 2 + 4095) / 4096 * 4096))
FIO_FILE=$SCRATCH/glmflash-fio-$$
OUT=$(mktemp -d)
trap 'rm -rf "$FIO_FILE" "$OUT"' EXIT

fio_gbps() { # name engine depth
    fio --name="$1" --filename="$FIO_FILE" --size=1G --bs="$RECORD" --rw=randread --direct=1 \
        --ioengine="$2" --iodepth="$3" --runtime="$FIO_SECONDS" --time_based \
        --output-format=json >"$OUT/$1.json"
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["jobs"][0]["read"]["bw_bytes"] / 1e9)' "$OUT/$1.json"
}
QD1=$(fio_gbps qd1 psync 1)
QD8=$(fio_gbps qd8 io_uring 8)
echo "fio O_DIRECT random reads of $RECORD B: QD1 $QD1 GB/s, QD8 $QD8 GB/s" >&2

"$BIN" bench --tiered --scratch "$SCRATCH" --hidden "$HIDDEN" --experts "$EXPERTS" \
    --expert-width "$WIDTH" --layers "$LAYERS" --top-k "$TOPK" --prompt-tokens "$PROMPT" \
    --warmup-tokens "$WARMUP" --decode-tokens "$DECODE" --vram-slots "$VRAM" --ram-slots "$RAM" \
    --zipf-bias "$ZIPF" >"$OUT/bench.json"
cat "$OUT/bench.json"

python3 - "$OUT/bench.json" "$QD1" "$QD8" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
qd1, qd8 = float(sys.argv[2]), float(sys.argv[3])
print(f"\nmemory read {b['memory_read_gb_s']:.1f} GB/s; fio O_DIRECT QD1 {qd1:.2f} GB/s, QD8 {qd8:.2f} GB/s\n")
print("| routing | policy | top-10% pick share | decode tok/s | hit vram / ram / nvme | MiB/token vram / ram / nvme | store read GB/s (vs the reader's own O_DIRECT rate) | ms/token needed / measured | roofline ratio (serial / overlapped) |")
print("|---|---|---|---|---|---|---|---|---|")
for r in b["runs"]:
    h, by = r["hit_rate"], r["bytes_per_token"]
    mib = lambda x: x / 1048576
    print(f"| {r['routing']} | {r['policy']} | {r['top_decile_pick_share']:.2f} | {r['decode_tok_s']:.2f} "
          f"| {h['vram']:.2f} / {h['ram']:.2f} / {h['nvme']:.2f} "
          f"| {mib(by['vram']):.1f} / {mib(by['ram']):.1f} / {mib(by['nvme']):.1f} "
          f"| {r['store_read_gb_s']:.2f} ({r['store_read_gb_s'] / r['store_o_direct_gb_s']:.2f}x of {r['store_o_direct_gb_s']:.2f}) "
          f"| {r['time_needed_ms_per_token']:.1f} / {r['time_measured_ms_per_token']:.1f} "
          f"| {r['roofline_ratio']:.2f} / {r['roofline_ratio_overlapped']:.2f} |")
PY
