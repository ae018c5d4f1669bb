#!/usr/bin/env bash
# Live parity check: builds a fresh set of reference fixtures with a random seed (nobody tuned
# the engine for them) and runs the engine's fixture tests against it.
#
#   e2e/fixtures_check.sh [SEED]      # needs: pip install -r e2e/requirements.txt
set -euo pipefail
cd "$(dirname "$0")/.."
seed="${1:-$(( (RANDOM << 15) | RANDOM ))}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
echo "fixtures check: seed $seed, dir $dir"
python3 e2e/make_fixtures.py --out "$dir" --seed "$seed"
GLMFLASH_FIXTURES="$dir" cargo test -q -p glmflash-node --test reference_fixtures -- --nocapture
