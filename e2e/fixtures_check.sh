#!/usr/bin/env bash
# Live parity check: builds a fresh set of reference fixtures with a random seed (nobody tuned
# the engine for them) and runs the engine's fixture tests against it.
#
#   e2e/fixtures_check.sh [SEED]      # needs: pip install -r e2e/requirements.txt
set -euo pipefail
cd "$(dirname "$0")/.."
seed="${1:-$(( (RANDOM << 15) | RANDOM ))}"
dir="$(mktemp -d)"
# On failure the seed is said last too (CI shows the end of the log): rerun with it.
trap 'rc=$?; rm -rf "$dir"; [ $rc = 0 ] || echo "fixtures check FAILED with seed $seed (rerun: e2e/fixtures_check.sh $seed)"' EXIT
echo "fixtures check: seed $seed, dir $dir"
python3 e2e/make_fixtures.py --out "$dir" --seed "$seed"
GLMFLASH_FIXTURES="$dir" cargo test -q -p glmflash-node --test reference_fixtures -- --nocapture

echo "named-intermediate dump of tiny_mixed: engine vs reference, op by op"
tokens="$(python3 -c "import json,sys;print(','.join(map(str,json.load(open(sys.argv[1]))['prompt'])))" "$dir/tiny_mixed/reference.json")"
cargo run -q --release -p glmflash-node -- logits --model "$dir/tiny_mixed" --tokens "$tokens" --dump "$dir/ours.safetensors" >/dev/null
python3 e2e/dump_reference.py --model "$dir/tiny_mixed" --tokens "$tokens" --out "$dir/ref.safetensors"
python3 e2e/compare_dumps.py "$dir/ours.safetensors" "$dir/ref.safetensors"
