#!/usr/bin/env bash
# Two binaries side by side on the same machine and the same model: `bench --flash` (see
# bench_flash.sh) with $BIN_A then $BIN_B, sharing one kept random model and store, and
# the decode and prefill figures of both in one table. For "no slowdown" claims of a change:
# build the old commit and the new one, carry both, run this once.
#   BIN_A=.device/glmflash-node-old BIN_B=.device/glmflash-node [LAYERS=1 RUNS=vram FORMAT=exl3:3] e2e/cuda/ab_flash.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-${OUT:-/tmp/device-out}}"
export LAYERS="${LAYERS:-1}" RUNS="${RUNS:-vram}" DECODERS="${DECODERS:-gpu}"
export WARMUP="${WARMUP:-4}" DECODE="${DECODE:-16}"
# One record format (bench_flash.sh's FORMATS, default q4_k), its results file as that names it.
export FORMATS="${FORMAT:-q4_k}"
name=flash
[ "$FORMATS" = q4_k ] || name="flash-${FORMATS/:/-}"
fail=0
for side in A B; do
  bin_var="BIN_$side"
  mkdir -p "$OUT/$side"
  echo "== $side: ${!bin_var}"
  BIN="${!bin_var}" e2e/cuda/bench_flash.sh "$OUT/$side" > "$OUT/$side/stdout.txt" 2>&1 || { fail=1; tail -5 "$OUT/$side/stdout.txt"; }
done
python3 - "$OUT" "$name" <<'PY'
import json, sys, pathlib
out, name = pathlib.Path(sys.argv[1]), sys.argv[2]
def rows(side):
    try:
        doc = json.loads((out / side / f"{name}.json").read_text())
    except Exception as e:
        return {}
    runs = doc.get("runs", doc if isinstance(doc, list) else [])
    table = {}
    for r in runs:
        key = (r.get("run"), r.get("phase"), r.get("decoder"), r.get("streams"))
        table[key] = (r.get("tok_s"), r.get("roofline_ratio"))
    return table
a, b = rows("A"), rows("B")
print(f"{'run':8} {'phase':8} {'decoder':7} {'streams':7} {'A tok/s':>9} {'B tok/s':>9} {'B/A':>6}")
for key in sorted(set(a) | set(b), key=str):
    ta, tb = (a.get(key) or (None,))[0], (b.get(key) or (None,))[0]
    ratio = f"{tb / ta:.3f}" if ta and tb else "-"
    print(f"{str(key[0]):8} {str(key[1]):8} {str(key[2]):7} {str(key[3]):7} {ta or '-':>9} {tb or '-':>9} {ratio:>6}")
PY
exit $fail
