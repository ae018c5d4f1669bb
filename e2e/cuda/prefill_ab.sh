#!/usr/bin/env bash
# The cold prefill under the 3090 budget (issue 17 item 3), each way the tiers can read a
# prompt's store misses, in turns on one kept model and store: `bench --flash --flash-runs
# prefill` (see bench_flash.sh) with
#   ahead    the default: each layer's misses read under its products, the next layer read ahead
#   overlap  GLMFLASH_BENCH_NO_PREFETCH=1: no read-ahead
#   first    GLMFLASH_BENCH_NO_FETCH_OVERLAP=1 GLMFLASH_BENCH_NO_PREFETCH=1: the batch read first
# then one line per run: tok/s, roofline ratio, the tiers' parts a step and the fetch thread's
# busy time. Results: $OUT/<way>-<round>/flash.json (and .log).
#   [WAYS="first overlap ahead"] [ROUNDS=1] [LAYERS=3] [PREFILL=8192] e2e/cuda/prefill_ab.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-${OUT:-/tmp/device-out}}"
export LAYERS="${LAYERS:-3}" RUNS=prefill DECODERS="${DECODERS:-gpu}" PREFILL="${PREFILL:-8192}"
export SCRATCH="${SCRATCH:-$PWD/.bench-scratch}"
fail=0
for round in $(seq 1 "${ROUNDS:-1}"); do
  for way in ${WAYS:-first overlap ahead}; do
    case $way in
      ahead) env=() ;;
      overlap) env=(GLMFLASH_BENCH_NO_PREFETCH=1) ;;
      first) env=(GLMFLASH_BENCH_NO_FETCH_OVERLAP=1 GLMFLASH_BENCH_NO_PREFETCH=1) ;;
      *) echo "WAYS: ahead, overlap or first, not $way" >&2; exit 2 ;;
    esac
    dir="$OUT/$way-$round"
    mkdir -p "$dir"
    env "${env[@]}" e2e/cuda/bench_flash.sh "$dir" > "$dir/stdout.txt" 2>&1 || { fail=1; tail -5 "$dir/stdout.txt"; }
    python3 - "$dir/flash.json" "$way" "$round" <<'PY'
import json, sys
path, way, rnd = sys.argv[1:4]
try:
    doc = json.load(open(path))
except Exception as e:
    print(f"{way} round {rnd}: no result ({e})")
    sys.exit(0)
for r in doc.get("runs", []):
    parts = r.get("tier_ms_per_step") or {}
    parts = " ".join(f"{k} {v:.0f}" for k, v in parts.items()) if isinstance(parts, dict) else parts
    print(f"{way:8} round {rnd}: {r.get('run')} {r.get('decoder')} {r.get('tok_s', 0):.1f} tok/s, "
          f"roofline {r.get('roofline_ratio', 0):.3f}; ms a step: {parts}; "
          f"fetch busy {r.get('fetch_busy_ms_per_step', 0):.0f}")
PY
  done
done
exit $fail
